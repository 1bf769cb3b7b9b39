#!/usr/bin/env bash
# Sprout beside Firecracker in one emulated lab run (QEMU TCG + nested SVM:
# EMULATED hardware virtualization, so only the ratios between the two
# columns of one run mean anything).
#
# Usage: tests/lab/bench-peer.sh FIRECRACKER [RUNS]   (default 20 per row)
# FIRECRACKER is a static Firecracker binary built from source (no prebuilt
# downloads here; docs/benchmarks.md says how). Both VMMs run the same
# vmlinux, the `test` image as the read-only root and the scratch template
# as the writable disk (Sprout: a top over it; Firecracker: a copy), 1 vCPU and 256 MiB; the guest agent answers
# both through their (compatible) vsock Unix sockets, reached with the same
# client (fc-peer, tests/src/bin/fc-peer.rs, drives Firecracker's API).
#   1. RUNS boots of each, alternating: VM start to the agent's first answer
#      (Sprout: `sprout vm run`; Firecracker: InstanceStart's answer to the
#      agent), and Firecracker's process spawn to VM start.
#   2. A parent of each runs 3 s and takes a full snapshot, then stops.
#   3. RUNS restores of each (Sprout: `--memory-backend mmap`; Firecracker:
#      the File backend), alternating, timed from the start of the restore to
#      the VM running, the agent answering and the first `true` ended.
#      Sprout restores twice a round: with its identity refresh (the
#      default, which Firecracker does not do) and with `--keep-identity`
#      (a ping, as Firecracker's).
# SCRUB=1 (the default) writes and frees 128 MiB of the lab's tmpfs before
# each boot or restore (see bench-boot.sh); SCRUB=0 does not.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
fc=${1:?usage: tests/lab/bench-peer.sh FIRECRACKER [RUNS]}
runs=${2:-20}
scrub=${SCRUB:-1}
case $scrub in 0 | 1) ;; *) echo "SCRUB is 0 or 1" >&2; exit 2 ;; esac
say() { printf '[bench-peer %s] %s\n' "$(date +%T)" "$*" >&2; }
[ -x "$fc" ] || { say "error: $fc is not an executable"; exit 2; }

# This checkout's lab, whatever <cache>/lab names by the time it runs.
SPROUT_LAB=$("$here/build.sh" | tail -n 1)
export SPROUT_LAB
say "building fc-peer"
cargo build --release --quiet --manifest-path "$root/Cargo.toml" -p sprout-tests --bin fc-peer
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
strip -o "$work/firecracker" "$fc"
strip -o "$work/fc-peer" "$root/target/release/fc-peer"
"$work/firecracker" --version 2>/dev/null | head -n 1 >&2
cat >"$work/script" <<EOS
F=/lab/firecracker P=/lab/fc-peer I=/opt/sprout/images
scrub() { [ $scrub = 0 ] || { dd if=/dev/zero of=/tmp/bench-scrub bs=1M count=128 2>/dev/null; rm -f /tmp/bench-scrub; }; }
mkdir -p /tmp/fc
# Firecracker's writable disk: a copy of the scratch template, made hole by
# hole by sprout (busybox's cp has no --sparse); the boot is a warm-up too.
sprout vm run --image test --cpus 1 --memory-mib 256 --disk /tmp/fc/disk.ext4 --exec true >/dev/null 2>&1 || exit 9
i=0
while [ \$i -lt $runs ]; do
  scrub
  # sprout times the agent from before Vm::start (create and start): the
  # time from the VM's start is the difference.
  RUST_LOG=service::linux=info sprout vm run --image test --cpus 1 --memory-mib 256 --exec true 2>&1 |
    sed -n -e 's/.*vm started .*, start \([0-9]*\) us,.*/start \1/p' \
      -e 's/.*agent ready \([0-9]*\) us after start.*/ready \1/p' |
    awk '\$1 == "start" { s = \$2 } \$1 == "ready" { print "sprout_boot_start_agent", \$2 - s }'
  scrub
  \$P boot --firecracker \$F --dir /tmp/fc --kernel /opt/sprout/vmlinux --rootfs \$I/test.ext4 --disk /tmp/fc/disk.ext4 ||
    { tail -n 30 /tmp/fc/fc.log; exit 10; }
  \$P stop --dir /tmp/fc
  i=\$((i + 1))
done
RUST_LOG=service=info sprout vm run --image test --cpus 1 --memory-mib 256 --api-sock /tmp/p.sock >/tmp/p.log 2>&1 &
sprout vm exec --api-sock /tmp/p.sock --exec true || exit 11
sleep 3
sprout vm snapshot --api-sock /tmp/p.sock --out /tmp/snap >/dev/null || exit 12
sprout vm ctl --api-sock /tmp/p.sock stop >/dev/null
wait
\$P boot --firecracker \$F --dir /tmp/fc --kernel /opt/sprout/vmlinux --rootfs \$I/test.ext4 --disk /tmp/fc/disk.ext4 >/dev/null ||
  { tail -n 30 /tmp/fc/fc.log; exit 13; }
sleep 3
\$P snapshot --dir /tmp/fc --out /tmp/fcsnap || { tail -n 30 /tmp/fc/fc.log; exit 14; }
i=0
while [ \$i -lt $runs ]; do
  scrub
  RUST_LOG=service::linux=info sprout vm restore /tmp/snap --memory-backend mmap --exec true 2>&1 |
    sed -n "s/.*restored \([0-9]*\) us after start.*/sprout_restore_running \1/p
            s/.*agent ready \([0-9]*\) us after start.*/sprout_restore_agent \1/p
            s/.*command ended \([0-9]*\) us after start.*/sprout_restore_exec \1/p"
  scrub
  RUST_LOG=service::linux=info sprout vm restore /tmp/snap --memory-backend mmap --keep-identity --exec true 2>&1 |
    sed -n "s/.*restored \([0-9]*\) us after start.*/sprout_kept_restore_running \1/p
            s/.*agent ready \([0-9]*\) us after start.*/sprout_kept_restore_agent \1/p
            s/.*command ended \([0-9]*\) us after start.*/sprout_kept_restore_exec \1/p"
  scrub
  \$P restore --firecracker \$F --dir /tmp/fc --snapshot /tmp/fcsnap || { tail -n 30 /tmp/fc/fc.log; exit 15; }
  i=\$((i + 1))
done
EOS
say "$runs runs per row, alternating, in one lab (test image, 1 vCPU, 256 MiB)"
SECONDS=0
"$here/run.sh" --timeout $((600 + runs * 120)) "$work/script" "$work/firecracker" "$work/fc-peer" >"$work/out"
say "lab run took $SECONDS s of host time"
grep -E '^(sprout|fc)_' "$work/out" >"$work/rows" || true
python3 - "$work/rows" "$runs" <<'PY'
import sys
rows = {}
for line in open(sys.argv[1]):
    name, v = line.split()
    rows.setdefault(name, []).append(int(v) / 1000)
runs = int(sys.argv[2])

def pct(v, p):
    v = sorted(v)
    return v[min(len(v) - 1, max(0, int(p / 100 * len(v) + 0.999999) - 1))]

steps = [("boot_spawn_start", "boot: process spawn to VM start"),
         ("boot_start_agent", "boot: VM start to agent answering"),
         ("snapshot", "full snapshot (pause included)"),
         ("restore_running", "restore: start to VM running"),
         ("restore_agent", "restore: start to agent answering"),
         ("restore_exec", "restore: start to first exec ended")]
# Sprout's restores again with --keep-identity: a ping, as Firecracker's,
# instead of the identity refresh Firecracker does not do.
kept = [("kept_" + k, f"{label}, Sprout with --keep-identity") for k, label in steps[3:]]
steps[4] = (steps[4][0], "restore: start to agent answering (Sprout: re-identified)")
print("| step (EMULATED) | Sprout p50 (p90) ms | Firecracker p50 (p90) ms | Sprout / Firecracker (p50) |")
print("| --- | --- | --- | --- |")
for key, label in steps + kept:
    s, f = rows.get("sprout_" + key, []), rows.get("fc_" + key.removeprefix("kept_"), [])
    cell = lambda v: f"{pct(v, 50):.1f} ({pct(v, 90):.1f}), n {len(v)}" if v else "-"
    ratio = f"{pct(s, 50) / pct(f, 50):.2f}" if s and f else "-"
    print(f"| {label} | {cell(s)} | {cell(f)} | {ratio} |")
want = ["sprout_boot_start_agent", "fc_boot_spawn_start", "fc_boot_start_agent"] + [
    f"{side}_restore_{k}" for side in ("sprout", "sprout_kept", "fc") for k in ("running", "agent", "exec")]
short = [f"{k}: {len(rows.get(k, []))} of {runs}" for k in want if len(rows.get(k, [])) != runs]
if short:
    print("missing samples: " + ", ".join(short))
    sys.exit(1)
PY
