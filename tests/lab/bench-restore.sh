#!/usr/bin/env bash
# The "restored VMs must never wedge" reproduction (issue #18), too slow for
# CI: tests/lab/restore-stress.sh run RUNS times in the lab, PER_BOOT
# iterations per outer VM boot, with the outer VM at --smp 1 or 2 (or
# alternating). Each iteration boots an original Linux VM with in-flight
# O_DIRECT I/O and a memory checker (tests/lab/inflight.py), snapshots it
# full and then diff under that I/O, restores each snapshot twice at once
# (mmap, uffd) beside the running original, and checks every VM's data. A
# step that does not finish in time is a hang: the lab script dumps every
# vCPU (and the outer kernel's view), and this script symbolises the guest
# RIPs against the guest kernel.
#
# Usage: tests/lab/bench-restore.sh [--runs N] [--per-boot K] [--smp 1|2|alt]
#                                   [--guest-cpus N] [--jobs J] [--out DIR]
#                                   [--tick periodic|oneshot] [--control]
#   defaults: 50 runs, 5 per boot, smp 1 (at 2, QEMU's nested SVM kills the
#   lab kernel and its guests now and then, docs/benchmarks.md), 2 guest
#   vCPUs, 1 job, out
#   /tmp/sprout-restore-stress, the lab's periodic tick. --jobs runs that many
#   labs at once (each is one emulated CPU per --smp). --tick oneshot runs the
#   lab kernel with the one-shot timer whose interrupt QEMU 7.2 can lose
#   (tests/lab/run.sh --tick): the lab then freezes now and then. --control
#   runs the control instead: the same load with no snapshot and no restore
#   (two freshly booted VMs in place of each pair of restores), to tell
#   whether a failure needs a snapshot or a restore at all.
# Prints one line per boot, then a summary, and a JSON line
# {"bench":"restore-stress",...}. Exits 1 if any iteration was not ok.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
runs=50 per_boot=5 smp=1 guest_cpus=2 jobs=1 out=/tmp/sprout-restore-stress tick=periodic control=0
while [ $# -gt 0 ]; do
  case "$1" in
    --runs) runs=$2; shift 2 ;;
    --per-boot) per_boot=$2; shift 2 ;;
    --smp) smp=$2; shift 2 ;;
    --guest-cpus) guest_cpus=$2; shift 2 ;;
    --jobs) jobs=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --tick) tick=$2; shift 2 ;;
    --control) control=1; shift ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
say() { printf '[bench-restore %s] %s\n' "$(date +%T)" "$*" >&2; }

# Every boot of this run uses the lab built now, even if a build from a
# changed tree relinks the cache's "lab" meanwhile (held in use until the end,
# so build.sh does not remove it).
SPROUT_LAB=$("$here/build.sh")
export SPROUT_LAB
exec 7>>"$SPROUT_LAB/.in-use"
flock -s 7
vmlinux=$("$root/guest/build-kernel.sh" 2>/dev/null)
mkdir -p "$out"
boots=$(( (runs + per_boot - 1) / per_boot ))
what=restores
[ "$control" = 1 ] && what="control (no snapshot, no restore)"
say "$runs iterations of $what, $per_boot per boot ($boots boots), outer smp $smp, $tick tick, guest vCPUs $guest_cpus, $jobs at once; logs in $out"

one_boot() {
  local b=$1 s=$2
  local n=$per_boot
  [ $(( b * per_boot )) -le "$runs" ] || n=$(( runs - (b - 1) * per_boot ))
  local log=$out/boot-$b
  local rc=0
  # Lab-time step limit 400 s; the host limit leaves room for every step.
  "$here/run.sh" --timeout $(( n * 1200 + 300 )) --smp "$s" --tick "$tick" --printk 4 --log "$log.console" - \
    "$here/inflight.py" "$here/restore-stress.sh" >"$log.out" 2>"$log.err" <<EOF || rc=$?
ITERATIONS=$n GUEST_CPUS=$guest_cpus DATA_MIB=1 MEM_MIB=4 PASSES=1 STEP_TIMEOUT=400 CONTROL=$control sh /lab/restore-stress.sh
EOF
  echo "$rc" >"$log.rc"
  local ok hang
  ok=$(grep -c '^result: iteration [0-9]* ok' "$log.out" || true)
  hang=$(grep -c '^result: iteration [0-9]* hang' "$log.out" || true)
  local why=""
  case "$rc" in
    0 | 1) ;;
    # run.sh's verdict on a lab that did not finish (its kernel panicked,
    # triple-faulted, locked up or froze): the emulated machine, not a guest.
    *) why=" ($(grep -o "\(the lab's own kernel\|the emulated machine\|the lab ended\|timed out\)[^:;]*" "$log.err" | head -n 1))" ;;
  esac
  # run.sh's reading of the lab kernel's local APIC at a freeze.
  grep -q 'QEMU lost it' "$log.err" && why="$why; QEMU lost the lab kernel's timer interrupt"
  # Guests that ended by themselves (a triple fault, a reset after a panic),
  # by name: orig (booted, snapshotted), r-* (restored), c-* (control).
  local ended
  ended=$(awk '/^--- \/tmp\/.*\.console \(tail\)/ { vm = $2; sub(".*/", "", vm); sub("\\.console", "", vm) }
    /VM ended: guest (triple fault|reset)/ { printf "%s%s: %s", sep, vm, ($5 == "triple" ? "triple fault" : "reset"); sep = ", " }' "$log.out")
  [ -n "$ended" ] && why="$why; guests ended: $ended"
  say "boot $b (smp $s): $ok of $n ok, $hang hung, lab status $rc$why"
}

b=1
while [ "$b" -le "$boots" ]; do
  for _ in $(seq "$jobs"); do
    [ "$b" -le "$boots" ] || break
    case "$smp" in
      alt) s=$(( (b % 2) + 1 )) ;;
      *) s=$smp ;;
    esac
    one_boot "$b" "$s" &
    b=$((b + 1))
  done
  wait
done

# Symbolise every rip= of the dumps against the guest kernel.
if grep -l 'rip=0x\|RIP=' "$out"/boot-*.out "$out"/boot-*.err >/dev/null 2>&1 && [ -f "$vmlinux" ]; then
  nm -n "$vmlinux" | grep -i ' [tw] ' >"$out/vmlinux.syms" || true
  python3 - "$out/vmlinux.syms" "$out"/boot-*.out "$out"/boot-*.err <<'PY'
import bisect, re, sys
syms = []
for line in open(sys.argv[1]):
    a, _, name = line.split()[:3]
    syms.append((int(a, 16), name))
addrs = [a for a, _ in syms]

def name(rip):
    """The guest kernel symbol at rip (our vmlinux is loaded at its link address)."""
    i = bisect.bisect_right(addrs, rip) - 1
    if rip < 0xffffffff80000000:
        return "user"
    if i < 0 or rip - syms[i][0] > 0x100000:
        return "not-the-guest-kernel"
    return "%s+%#x" % (syms[i][1], rip - syms[i][0])

for path in sys.argv[2:]:
    text = open(path).read()
    # sprout vm ctl vcpus: rip=0x...; QEMU's view of a frozen lab: RIP=<16 hex>.
    new = re.sub(r"rip=(0x[0-9a-f]+)", lambda m: "%s sym=%s" % (m.group(0), name(int(m.group(1), 16))), text)
    new = re.sub(r"RIP=([0-9a-f]{16})", lambda m: "%s sym=%s" % (m.group(0), name(int(m.group(1), 16))), new)
    if new != text:
        open(path, "w").write(new)
PY
fi
# (A frozen lab's QEMU dump is in boot-N.err.)

total_ok=$(cat "$out"/boot-*.out 2>/dev/null | grep -c '^result: iteration [0-9]* ok' || true)
total_hang=$(cat "$out"/boot-*.out 2>/dev/null | grep -c '^result: iteration [0-9]* hang' || true)
total_err=$(cat "$out"/boot-*.out 2>/dev/null | grep -c '^result: iteration [0-9]* errors' || true)
lab_fail=$(cat "$out"/boot-*.rc | grep -vc '^[01]$' || true)
total_failed=$(cat "$out"/boot-*.out 2>/dev/null | grep -c '^result: iteration [0-9]* failed' || true)
total_run=$(cat "$out"/boot-*.out 2>/dev/null | grep -c '^result: iteration' || true)
say "done: $total_run of $runs iterations ran: $total_ok ok, $total_hang hung, $total_err with data errors, $total_failed failed otherwise; $lab_fail boots where the lab itself failed (the rest of their iterations did not run)"
for f in "$out"/boot-*.out; do
  grep -q '=== HANG' "$f" && say "hang dump: $f"
done
printf '{"bench":"restore-stress","runs":%d,"ran":%d,"ok":%d,"hang":%d,"errors":%d,"failed":%d,"lab_failures":%d,"smp":"%s","tick":"%s","guest_cpus":%d,"control":%s}\n' \
  "$runs" "$total_run" "$total_ok" "$total_hang" "$total_err" "$total_failed" "$lab_fail" "$smp" "$tick" "$guest_cpus" \
  "$([ "$control" = 1 ] && echo true || echo false)"
[ "$total_ok" = "$runs" ]
