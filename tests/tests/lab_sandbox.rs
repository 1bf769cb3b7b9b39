//! Snapshot, restore and fork of Linux guests, in the emulated
//! hardware-virtualization lab (see `sprout_tests::lab`): what a restored or
//! forked guest keeps (processes, files), and what it must not share with its
//! siblings (clock, entropy, CRNG output, host name).

use std::collections::HashSet;

use sprout_tests::lab;

/// Host time with microseconds, from busybox `adjtimex` (its `date` has no %N).
const NOW: &str =
    r#"now() { adjtimex | awk '/tv_sec/{s=$2} /tv_usec/{u=$2} END{printf "%d.%06d\n", s, u}'; }"#;

/// Boots a Linux VM on the test image with a control socket at `/tmp/p.sock`
/// in the background, and waits for its agent.
const BOOT_PARENT: &str = "sprout vm run --image test --disk /tmp/rw.ext4 --api-sock /tmp/p.sock \
     >/tmp/parent.console 2>&1 &\n";

fn secs(v: &str) -> f64 {
    v.parse()
        .unwrap_or_else(|_| panic!("{v:?} is not a time in seconds"))
}

/// Three restores take new identities; a fourth with `--keep-identity` is
/// the guest exactly as it was (its clock behind, its host name the
/// parent's).
#[test]
fn a_restored_guest_keeps_processes_and_files_and_takes_a_new_identity() {
    let script = format!(
        r#"{NOW}
{BOOT_PARENT}
sprout vm exec --api-sock /tmp/p.sock --exec '
  echo kept > /workspace/note
  # Renamed into place: `>` truncates before it writes, and a read (or the
  # snapshot) in between would see an empty file.
  (i=0; while :; do i=$((i+1)); echo $i > /tmp/counter.new; mv /tmp/counter.new /tmp/counter; sleep 0.2; done) >/dev/null 2>&1 &
  sleep 1; echo parent-host: $(hostname)' || exit 10
sprout vm snapshot --api-sock /tmp/p.sock --out /tmp/snap || exit 11
sprout vm exec --api-sock /tmp/p.sock --exec 'echo at-snapshot: $(cat /tmp/counter)' || exit 12
sprout vm ctl --api-sock /tmp/p.sock stop
wait
# Long enough that a guest clock nobody set would be visibly behind.
sleep 3
cat > /tmp/g.sh <<'EOF'
{NOW}
echo guest-clock: $(now)
echo counter: $(cat /tmp/counter); sleep 1; echo counter-later: $(cat /tmp/counter)
echo note: $(cat /workspace/note)
echo uuid: $(cat /proc/sys/kernel/random/uuid) $(cat /proc/sys/kernel/random/uuid)
echo host: $(hostname)
EOF
for b in mmap uffd uffd keep; do
  rm -f /tmp/got
  echo "host-before: $(now)"
  case $b in keep) o='--memory-backend mmap --keep-identity' ;; *) o="--memory-backend $b" ;; esac
  sprout vm restore /tmp/snap $o --put /tmp/g.sh:g.sh --exec 'sh /workspace/g.sh' \
    --get note:/tmp/got
  echo "status: $?"
  echo "got: $(cat /tmp/got)"
  echo "host-after: $(now)"
done
"#
    );
    let out = lab::run(&script);
    out.assert_success();
    let o = &out.stdout;
    assert_eq!(out.values("status:"), ["0", "0", "0", "0"], "{o}");
    // The process that advanced the counter runs on from the snapshot's value.
    let at_snap: u64 = out.values("at-snapshot:")[0].parse().unwrap();
    let c: Vec<u64> = out
        .values("counter:")
        .iter()
        .map(|v| v.parse().unwrap())
        .collect();
    let later: Vec<u64> = out
        .values("counter-later:")
        .iter()
        .map(|v| v.parse().unwrap())
        .collect();
    assert_eq!(c.len(), 4, "{o}");
    for (a, b) in c.iter().zip(&later) {
        // Taken just before the snapshot's answer, so a step or two either way.
        // at-snapshot was read just after the snapshot: a few steps later.
        assert!(
            *a + 5 >= at_snap && *a <= at_snap + 100,
            "{c:?} vs {at_snap}\n{o}"
        );
        assert!(
            b > a,
            "the guest's process did not run on: {c:?} -> {later:?}\n{o}"
        );
    }
    assert_eq!(out.values("note:"), ["kept"; 4], "{o}");
    // --get brought the guest's file out.
    assert_eq!(out.values("got:"), ["kept"; 4], "{o}");
    // The wall clock was set from the host's: within 1 s of it.
    let (before, after, guest) = (
        out.values("host-before:"),
        out.values("host-after:"),
        out.values("guest-clock:"),
    );
    for i in 0..3 {
        let g = secs(guest[i]);
        assert!(
            g >= secs(before[i]) - 1.0 && g <= secs(after[i]) + 1.0,
            "restore {i}: guest clock {g} outside host [{}, {}] by more than 1 s\n{o}",
            before[i],
            after[i]
        );
    }
    // --keep-identity: nobody set the clock, which went on from the
    // snapshot's instant, seconds ago (the sleep and three restores).
    let g = secs(guest[3]);
    assert!(
        g < secs(before[3]) - 2.0,
        "kept identity: guest clock {g} is not behind the host's {}\n{o}",
        before[3]
    );
    // A reseeded CRNG: no two restores give the same UUID sequence.
    let uuids: Vec<&str> = out.values("uuid:");
    assert_eq!(uuids.len(), 4, "{o}");
    assert_eq!(uuids.iter().collect::<HashSet<_>>().len(), 4, "{uuids:?}");
    let hosts: Vec<&str> = out.values("host:");
    let parent = out.values("parent-host:")[0];
    assert_eq!(
        hosts[..3].iter().collect::<HashSet<_>>().len(),
        3,
        "{hosts:?}"
    );
    assert!(!hosts[..3].contains(&parent), "{hosts:?} vs {parent}");
    assert_eq!(hosts[3], parent, "kept identity: {hosts:?}");
}

#[test]
fn forked_guests_are_isolated_and_each_takes_a_new_identity() {
    // Each child: what it inherited, then its own file, 32 random bytes, a
    // UUID and its host name.
    let script = format!(
        r#"{BOOT_PARENT}
sprout vm exec --api-sock /tmp/p.sock --exec 'echo parent > /workspace/who; echo parent-host: $(hostname); echo parent-machine: $(cat /etc/machine-id)' || exit 10
sprout vm fork --api-sock /tmp/p.sock --count 3 > /tmp/kids || exit 11
i=0
for k in $(cat /tmp/kids); do
  i=$((i+1))
  sprout vm exec --api-sock $k --exec "echo inherited: \$(cat /workspace/who); echo child$i > /workspace/who
    echo random: \$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')
    echo uuid: \$(cat /proc/sys/kernel/random/uuid)
    echo machine: \$(cat /etc/machine-id)
    echo host: \$(hostname)" || exit 12
  # Each child is its own worker process.
  echo child-pid: $(sprout vm ctl --api-sock $k describe | sed -n 's/^pid //p')
done
echo parent-pid: $(sprout vm ctl --api-sock /tmp/p.sock describe | sed -n 's/^pid //p')
sprout vm exec --api-sock /tmp/p.sock --exec 'echo parent-later > /workspace/who' || exit 13
i=0
for k in $(cat /tmp/kids); do
  i=$((i+1))
  sprout vm exec --api-sock $k --exec 'echo own: $(cat /workspace/who)' || exit 14
done
sprout vm exec --api-sock /tmp/p.sock --exec 'echo parent-own: $(cat /workspace/who)' || exit 15
# A child of a child sees what its parent wrote before the fork, not after.
k1=$(head -n 1 /tmp/kids)
sprout vm fork --api-sock $k1 --count 1 > /tmp/grandkid || exit 16
sprout vm exec --api-sock $k1 --exec 'echo child1-later > /workspace/who' || exit 17
sprout vm exec --api-sock $(cat /tmp/grandkid) --exec 'echo grandchild-sees: $(cat /workspace/who); echo grandchild-host: $(hostname); echo machine: $(cat /etc/machine-id)' || exit 18
sprout vm ctl --api-sock /tmp/p.sock stop
wait
# The children outlive their parent; then they stop too.
for k in $(cat /tmp/kids /tmp/grandkid); do sprout vm ctl --api-sock $k stop || exit 19; done
"#
    );
    let out = lab::run(&script);
    out.assert_success();
    let o = &out.stdout;
    assert_eq!(out.values("inherited:"), ["parent"; 3], "{o}");
    assert_eq!(out.values("own:"), ["child1", "child2", "child3"], "{o}");
    assert_eq!(out.values("parent-own:"), ["parent-later"], "{o}");
    assert_eq!(out.values("grandchild-sees:"), ["child1"], "{o}");
    let random = out.values("random:");
    assert_eq!(random.len(), 3, "{o}");
    for r in &random {
        assert_eq!(r.len(), 64, "32 bytes in hex: {r:?}");
    }
    assert_eq!(random.iter().collect::<HashSet<_>>().len(), 3, "{random:?}");
    let uuids = out.values("uuid:");
    assert_eq!(uuids.iter().collect::<HashSet<_>>().len(), 3, "{uuids:?}");
    let mut hosts = out.values("host:");
    hosts.extend(out.values("parent-host:"));
    hosts.extend(out.values("grandchild-host:"));
    assert_eq!(hosts.len(), 5, "{o}");
    assert_eq!(hosts.iter().collect::<HashSet<_>>().len(), 5, "{hosts:?}");
    // The booted parent was given a machine id of its own (the test image
    // has none), and every child (overwriting it in place) a new one.
    let mut machines = out.values("machine:");
    assert_eq!(machines.len(), 4, "{o}");
    machines.extend(out.values("parent-machine:"));
    assert_eq!(machines.len(), 5, "{o}");
    assert!(
        machines
            .iter()
            .all(|m| m.len() == 32 && m.bytes().all(|b| b.is_ascii_hexdigit())),
        "{machines:?}"
    );
    assert_eq!(
        machines.iter().collect::<HashSet<_>>().len(),
        5,
        "{machines:?}"
    );
    let mut pids = out.values("child-pid:");
    assert_eq!(pids.len(), 3, "{o}");
    pids.extend(out.values("parent-pid:"));
    assert!(pids.iter().all(|p| p.parse::<u32>().is_ok()), "{pids:?}");
    assert_eq!(pids.iter().collect::<HashSet<_>>().len(), 4, "{pids:?}");
}
