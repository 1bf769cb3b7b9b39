#!/usr/bin/env bash
# Process spawn to VM start of a sproutd cold boot, measured in the emulated
# lab (QEMU TCG + nested SVM: EMULATED hardware virtualization, so these
# numbers are NOT what a hardware-virtualization host gives; compare the two
# columns of one run only).
#
# Usage: tests/lab/bench-spawn.sh [BOOTS] [IMAGE]   (default: 12 boots each, test image)
# Three sproutd run in one lab (jailed workers, no templates, so every
# create cold-boots), and creates alternate between them:
# - small: no ready workers, so every create spawns a worker, from the
#   static `sprout-worker` beside sprout (what the lab and an install have);
# - one: the same, but its workers are the whole `sprout` binary run as
#   `sprout worker` (no sprout-worker beside it);
# - ready: as small, with the default one ready worker per shape: after the
#   first create, each boots into a waiting worker's shell (its KVM VM,
#   vCPUs and memory slots made), so no process starts on the create path.
# For each create, sproutd logs the time from the worker's spawn (or its
# take from the ready pool) to its VM's start (the worker answering, then
# the boot request: `Vm::create` and the vCPUs started), and the worker logs
# each step of `Vm::create`; this prints them as p50/p90/min/max.
# SCRUB=1 (the default) writes and frees 128 MiB of tmpfs in the lab before
# each create (see tests/lab/bench-boot.sh for why); SCRUB=0 does not.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
boots=${1:-12}
image=${2:-test}
scrub=${SCRUB:-1}
case $scrub in 0 | 1) ;; *) echo "SCRUB is 0 or 1" >&2; exit 2 ;; esac
say() { printf '[bench-spawn %s] %s\n' "$(date +%T)" "$*" >&2; }

# This checkout's lab, whatever <cache>/lab names by the time it runs.
SPROUT_LAB=$("$here/build.sh" | tail -n 1)
export SPROUT_LAB
script=$(mktemp)
out=$(mktemp)
trap 'rm -f "$script" "$out"' EXIT
cat >"$script" <<EOS
ip link set lo up 2>/dev/null || ifconfig lo 127.0.0.1 up 2>/dev/null
[ -x /opt/sprout/bin/sprout-worker ] || { echo "no sprout-worker in the lab"; exit 9; }
# The other sproutd's binary has no sprout-worker beside it.
mkdir -p /opt/sprout/one
cp /opt/sprout/bin/sprout /opt/sprout/one/sprout
start() { # MODE PORT BIN READY
  RUST_LOG=info,vmm::create=debug,sprout_worker=debug \$3 daemon --no-lab --listen 127.0.0.1:\$2 --data-dir /tmp/sd-\$1 --no-templates \
    --ready-workers \$4 --no-network >/tmp/sd-\$1.out 2>/tmp/sd-\$1.log &
  i=0
  until sprout api --addr 127.0.0.1:\$2 GET /v1/health >/dev/null 2>&1; do
    i=\$((i+1)); [ \$i -gt 600 ] && { cat /tmp/sd-\$1.log; exit 10; }
    sleep 0.1
  done
}
start small 7070 /opt/sprout/bin/sprout 0
start one 7071 /opt/sprout/one/sprout 0
start ready 7072 /opt/sprout/bin/sprout 1
i=0
while [ \$i -lt $boots ]; do
  for port in 7070 7071 7072; do
    # After the first, a ready create waits for its ready worker.
    j=0
    while [ \$port = 7072 ] && [ \$i -gt 0 ] && [ "\$(grep -c 'a ready worker of' /tmp/sd-ready.log)" -lt \$i ]; do
      j=\$((j+1)); [ \$j -gt 600 ] && { echo "no ready worker"; tail -n 20 /tmp/sd-ready.log; exit 13; }
      sleep 0.1
    done
    if [ $scrub = 1 ]; then
      dd if=/dev/zero of=/tmp/bench-scrub bs=1M count=128 2>/dev/null; rm -f /tmp/bench-scrub
    fi
    o=\$(sprout api --addr 127.0.0.1:\$port POST /v1/runtime/schedule '{"image":"$image","cpus":1,"memoryMb":256}' 2>&1) ||
      { echo "create failed: \$o"; tail -n 20 /tmp/sd-small.log /tmp/sd-one.log /tmp/sd-ready.log; exit 11; }
    id=\$(echo "\$o" | sed -n 's/.*"vmId":"\([^"]*\)".*/\1/p')
    m=small; [ \$port = 7071 ] && m=one; [ \$port = 7072 ] && m=ready
    # The worker's own view: main to listening, and each step of Vm::create
    # (not for the ready sproutd's first create, which spawned its worker).
    [ \$m = ready ] && [ \$i = 0 ] ||
    sed -n -e 's/.*listening \([0-9]*\) us after main, \([0-9]*\) minor.*/listen_us=\1 listen_faults=\2/p' \
      -e 's/.*vm created: \(.*\)/\1/p' /tmp/sd-\$m/vms/\$id/worker.log | tr '\n' ' ' |
      sed "s/^/worker mode=\$m /; s/\\\$/\\n/"
    sprout api --addr 127.0.0.1:\$port DELETE /v1/runtime/vms/\$id >/dev/null 2>&1 || { echo "delete failed"; exit 12; }
  done
  i=\$((i + 1))
done
for m in small one; do
  sed -n "s/.*VM started \([0-9]*\) us after the worker's spawn: worker up \([0-9]*\) us, boot \([0-9]*\) us.*/spawn mode=\$m total_us=\1 up_us=\2 boot_us=\3/p" /tmp/sd-\$m.log
done
# The ready sproutd's first create spawned its worker: not counted.
sed -n "s/.*VM started \([0-9]*\) us after the worker's spawn: worker up \([0-9]*\) us, boot \([0-9]*\) us (a ready worker).*/spawn mode=ready total_us=\1 up_us=\2 boot_us=\3/p" /tmp/sd-ready.log
EOS
say "$boots creates from each of three sproutd in the lab ($image image, 1 vCPU, 256 MiB)"
"$here/run.sh" --timeout $((300 + boots * 120)) "$script" >"$out"
n=$(grep -c '^spawn ' "$out" || true)
[ "$n" = $((boots * 3 - 1)) ] || { cat "$out" >&2; say "error: $n of $((boots * 3 - 1)) creates logged their spawn"; exit 1; }
python3 - "$out" <<'PY'
import re, sys
rows = {}
for line in open(sys.argv[1]):
    if line.startswith("spawn ") or line.startswith("worker "):
        m = re.search(r"mode=(\w+)", line).group(1)
        b = {k: int(v) / 1000 for k, v in re.findall(r"(\w+)_us=(\d+)", line)}
        b.update({k + "_faults": int(v) for k, v in re.findall(r"(\w+)_faults=(\d+)", line)})
        rows.setdefault((line.split()[0], m), []).append(b)

def pct(v, p):
    v = sorted(v)
    return v[min(len(v) - 1, max(0, int(p / 100 * len(v) + 0.999999) - 1))]

names = [("spawn", "total", "worker spawn (or take) to VM start"),
         ("spawn", "up", "spawn to the worker answering (or take)"),
         ("worker", "listen", "worker main to listening (jail entered; a ready one's is off the path)"),
         ("spawn", "boot", "boot request (Vm::create, vCPUs started)"),
         ("worker", "total", "Vm::create"),
         ("worker", "kvm", "create: KVM VM"),
         ("worker", "memory", "create: memory"),
         ("worker", "kernel", "create: kernel load"),
         ("worker", "devices", "create: devices"),
         ("worker", "vcpus", "create: vCPUs"),
         ("worker", "threads", "create: threads")]
modes = {"small": "sprout-worker (static, 2.9 MiB)", "one": "sprout worker (26 MiB)", "ready": "a ready worker's shell"}
print("| phase, ms (minor faults) | worker binary | runs | p50 | p90 | min | max |")
print("| --- | --- | --- | --- | --- | --- | --- |")
for src, k, name in names:
    for m, label in modes.items():
        got = [b for b in rows.get((src, m), []) if k in b]
        v = [b[k] for b in got]
        if not v:
            continue
        f = [b[k + "_faults"] for b in got if k + "_faults" in b]
        faults = f" ({pct(f, 50)})" if f else ""
        print(f"| {name}{faults} | {label} | {len(v)} | {pct(v, 50):.1f} | {pct(v, 90):.1f} | {min(v):.1f} | {max(v):.1f} |")
PY
