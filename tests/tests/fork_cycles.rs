//! 100 fork-and-destroy cycles leave host fds, threads and memory at their
//! baseline and no files behind. Alone in its test binary: it counts
//! process-wide.

use guest_abi::layout::TESTGUEST_SCRATCH;
use guest_abi::mailbox as mb;
use sprout_tests::{boot, call, config, fd_count, thread_count, TempDir};
use vmm::ForkOptions;

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches(" kB").trim().parse().ok())
        .unwrap()
}

#[test]
fn a_hundred_fork_and_destroy_cycles_leave_nothing_behind() {
    let dir = TempDir::new("fork-cycles");
    let (cfg, console) = config(1, 256);
    let mut parent = boot(cfg, &console);
    let opts = ForkOptions::new(dir.path());
    // Warm up: the first fork writes a full layer, later ones diffs.
    for _ in 0..3 {
        drop(parent.fork(1, &opts, None).unwrap());
    }
    // The parent holds one lease (an open file) per fork layer of its chain,
    // which is as deep as the compaction rule lets it be: not a leak.
    let leased = |vm: &vmm::Vm| vm.lineage().leases().len();
    let (fds, threads, rss) = (fd_count() - leased(&parent), thread_count(), rss_kib());
    for i in 0..100u64 {
        let child = parent.fork(1, &opts, None).unwrap().pop().unwrap();
        call(&child, 0, mb::CMD_FILL, [TESTGUEST_SCRATCH, 64, i, 0]);
        call(&parent, 0, mb::CMD_COUNT, [1, 0, 0, 0]);
        drop(child);
    }
    assert_eq!(fd_count() - leased(&parent), fds, "file descriptors leaked");
    assert_eq!(thread_count(), threads, "threads leaked");
    let grown = rss_kib().saturating_sub(rss);
    assert!(grown < 32 * 1024, "RSS grew by {grown} KiB over 100 cycles");
    // Only the parent's current chain of fork layers remains (compacted).
    let layers = std::fs::read_dir(dir.path()).unwrap().count();
    assert!(layers <= vmm::MAX_CHAIN_DEPTH, "{layers} layer dirs kept");
    drop(parent);
    let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
    assert!(left.is_empty(), "left behind: {left:?}");
}
