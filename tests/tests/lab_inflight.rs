//! In-flight I/O across snapshot and restore, checked by its data (issue #18),
//! in the emulated hardware-virtualization lab: one iteration of
//! tests/lab/restore-stress.sh. A Linux VM runs tests/lab/inflight.py (eight
//! O_DIRECT writers, each pass writing then reading back and checking every
//! block of its slice, and a memory checker); a full and then a diff snapshot
//! are taken while that I/O runs; each is restored twice at once (mmap and
//! uffd) beside the running original; every VM must go on making passes with
//! no error while each of its vCPUs enters `KVM_RUN` again, and a last check of every block at the end must find each block
//! whole and its own. The checker's negative control (a corrupted and a
//! misplaced block) runs first and must find exactly those two.
//!
//! tests/lab/bench-restore.sh runs the same many times (docs/benchmarks.md).

use std::time::Duration;

use sprout_tests::lab;

#[test]
fn in_flight_io_survives_full_and_diff_snapshots_and_concurrent_restores() {
    let here = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("lab");
    assert!(here.join("inflight.py").is_file(), "{}", here.display());
    let out = lab::Script::new(
        "ITERATIONS=1 GUEST_CPUS=2 DATA_MIB=1 MEM_MIB=4 PASSES=1 STEP_TIMEOUT=400 SELFTEST=1 \
         sh /lab/restore-stress.sh\n",
    )
    .file(here.join("inflight.py"))
    .file(here.join("restore-stress.sh"))
    .timeout(Duration::from_secs(1500))
    .run();
    let o = &out.stdout;
    assert!(
        o.contains("inflight: selftest found bad blocks [5, 11]"),
        "the checker's negative control did not find the bad blocks:\n{o}"
    );
    out.assert_success();
    // Three VMs checked after each snapshot's restores...
    assert_eq!(
        o.matches("inflight: progressed").count(),
        6,
        "expected 6 progress checks:\n{o}"
    );
    // Every vCPU of every checked VM entered KVM_RUN again meanwhile.
    assert_eq!(o.matches("vcpus-ran: ").count(), 6, "{o}");
    // ...and five final checks of every block, all error-free.
    let finals: Vec<&str> = o
        .lines()
        .filter(|l| l.starts_with("inflight: final"))
        .collect();
    assert_eq!(finals.len(), 5, "{o}");
    for f in finals {
        assert!(
            f.contains(" errors=0 ") && f.ends_with("mem_errors=0"),
            "{f}\n{o}"
        );
    }
    assert!(o.contains("result: iteration 1 ok"), "{o}");
}
