#!/usr/bin/env bash
# Runs a shell script inside the emulated hardware-virtualization lab (built by
# tests/lab/build.sh) and brings back its output and exit status.
#
# Usage: tests/lab/run.sh [--timeout SECS] [--stall SECS] [--smp N] [--log FILE] SCRIPT [FILE...]
#   SCRIPT     a shell script (or - for stdin), run as /lab/script.sh with sh
#              (busybox) in /tmp of the outer VM; PATH has sprout, and
#              SPROUT_CACHE=/opt/sprout holds vmlinux, testguest and images/
#              (busybox's sh runs its own applets before anything on PATH:
#              iproute2's ip is /usr/sbin/ip by name)
#   FILE...    extra files, copied to /lab/ beside the script
#   --timeout  host-time limit in seconds (default 600): the outer VM runs on an
#              emulated CPU, its own clock under-reports
#   --smp      vCPUs of the outer VM (default: $SPROUT_LAB_SMP or 1). With 2,
#              QEMU's nested SVM corrupts kernel state now and then: the lab's
#              own kernel and its guests, booted ones too, die of page faults
#              at kernel entry with a wrong GS base (QEMU 7.2 and 10.0, lab
#              kernels 6.1 and 6.12, docs/benchmarks.md); hence the default.
#   --log      keep the whole serial console (kernel messages included) here
#   --printk   the lab kernel's console log level (default 1: only emergencies,
#              so kernel messages do not mix with the script's output)
#   --tick     the lab kernel's timer tick: periodic (default) or oneshot.
#              QEMU 7.2 (Debian 12's) can lose the lab kernel's timer
#              interrupt while a nested guest runs: its VMRUN sets
#              interrupt_request without QEMU's lock, racing the timer
#              thread's request to poll the local APIC, and a lost poll
#              leaves the timer's vector pending in the APIC's IRR with
#              nothing to deliver it (fixed upstream in 2025 by making that
#              field atomic). A one-shot timer is then never re-armed, and a
#              guest spinning on a lock (no PAUSE exits under TCG) keeps the
#              emulated CPU for good. A periodic tick (nohz=off highres=off)
#              raises the timer again every jiffy, which recovers the lost
#              poll. oneshot reproduces the freeze (docs/benchmarks.md).
#              SPROUT_LAB_TICK sets the default.
#   Environment, for telling emulator failures apart (docs/benchmarks.md,
#   issue 18): SPROUT_LAB_ACCEL, QEMU's -accel (default tcg; e.g.
#   tcg,thread=single runs every emulated CPU on one host thread);
#   SPROUT_LAB_CPU, its -cpu (default max; e.g. max,la57=off). QEMU is the
#   first qemu-system-x86_64 on PATH.
#   --stall    host seconds without the lab kernel's heartbeat (it prints one
#              every 5 s of its own time, which runs slow) after which the emulated machine
#              counts as frozen (default 300): QEMU's monitor then shows where
#              each emulated CPU is (info cpus, info registers, twice), the
#              RIPs are printed for symbolising, and the run ends with 127
# Prints the script's output (between the lab's markers) on stdout and exits
# with the script's status; 124 if the host-time limit passed, 125 if the lab
# itself failed (no exit marker: the console is then printed on stderr), 126 if
# the outer kernel panicked, triple-faulted or locked up (it panics on a soft
# lockup rather than hang), 127
# if the emulated machine froze (no heartbeat: not a test's own hang, which the
# lab kernel would outlive).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
cache=${SPROUT_CACHE:-$HOME/.cache/sprout}
lab=${SPROUT_LAB:-$cache/lab}
timeout=600
smp=${SPROUT_LAB_SMP:-1}
stall=300
tick=${SPROUT_LAB_TICK:-periodic}
printk=1
log=

say() { printf '[lab-run %s] %s\n' "$(date +%T)" "$*" >&2; }
die() { say "error: $*"; exit 125; }

while [ $# -gt 0 ]; do
  case "$1" in
    --timeout) timeout=$2; shift 2 ;;
    --smp) smp=$2; shift 2 ;;
    --stall) stall=$2; shift 2 ;;
    --tick) tick=$2; shift 2 ;;
    --printk) printk=$2; shift 2 ;;
    --log) log=$2; shift 2 ;;
    --) shift; break ;;
    -?*) die "unknown option $1" ;;
    *) break ;;
  esac
done
[ $# -ge 1 ] || die "usage: $0 [--timeout SECS] [--smp N] [--tick periodic|oneshot] [--log FILE] SCRIPT [FILE...]"
case "$tick" in
  periodic) tick_args="nohz=off highres=off" ;;
  oneshot) tick_args="" ;;
  *) die "--tick is periodic or oneshot, not $tick" ;;
esac
script=$1
shift
[ -f "$lab/initrd.cpio" ] && [ -f "$lab/vmlinuz" ] || die "the lab is not built at $lab: run tests/lab/build.sh"
# In use while this runs: build.sh removes no lab that is (see there).
exec 6>>"$lab/.in-use"
flock -s 6
command -v qemu-system-x86_64 >/dev/null || die "qemu-system-x86_64 is missing: apt-get install --no-install-recommends qemu-system-x86"

tmp=$(mktemp -d "${TMPDIR:-/tmp}/sprout-lab.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/extra/lab"
if [ "$script" = - ]; then
  cat >"$tmp/extra/lab/script.sh"
else
  cp "$script" "$tmp/extra/lab/script.sh"
fi
for f in "$@"; do
  cp "$f" "$tmp/extra/lab/"
done
# The per-run files ride in a second newc archive appended to the lab's:
# Linux unpacks concatenated archives in order.
(cd "$tmp/extra" && find lab | cpio -o -H newc -R 0:0 --quiet) >"$tmp/extra.cpio"
cat "$lab/initrd.cpio" "$tmp/extra.cpio" >"$tmp/initrd"

disk=()
[ -f "$lab/images.ext4" ] && disk=(-drive "file=$lab/images.ext4,if=virtio,format=raw,readonly=on")
console=${log:-$tmp/console}
# The lab's own clock runs close to the host's: a state dump a minute before
# the limit shows what hung (tests/lab/init).
diag=$(( timeout > 120 ? timeout - 60 : timeout * 3 / 4 ))
# QEMU's human monitor on two FIFOs: what the emulated CPUs do when the
# lab's kernel stops (its own diagnostics cannot run then).
mkfifo "$tmp/mon.in" "$tmp/mon.out"
: >"$console"
SECONDS=0
set +e
timeout --kill-after=10 "$timeout" qemu-system-x86_64 -accel "${SPROUT_LAB_ACCEL:-tcg}" -cpu "${SPROUT_LAB_CPU:-max}" -m 2G -smp "$smp" \
  -nographic -no-reboot -kernel "$lab/vmlinuz" -initrd "$tmp/initrd" \
  -chardev "pipe,id=mon,path=$tmp/mon" -mon chardev=mon,mode=readline \
  -d cpu_reset,guest_errors -D "$tmp/qemu.log" \
  -append "console=ttyS0 panic=-1 softlockup_panic=1 nokaslr quiet lab.diag=$diag lab.printk=$printk $tick_args" "${disk[@]}" </dev/null >"$console" 2>&1 &
qemu=$!
# Keep the monitor's output drained (and kept), and a writer open on its input.
# (Both FIFOs opened read-write: an open never waits for a QEMU that failed to start.)
cat 0<>"$tmp/mon.out" >"$tmp/monitor.log" &
monitor_reader=$!
exec 8<>"$tmp/mon.in"
# Says whose code each emulated CPU was running in QEMU's monitor output $1
# (its "x /16xb $pc" lines): the bytes at its RIP are compared with the
# guest kernel's own (a Sprout guest's, which links at a fixed address), and
# the RIP is named in the guest kernel.
where_cpus_were() {
  python3 - "$1" "$lab/guest.syms" "$(cat "$lab/guest.vmlinux" 2>/dev/null)" <<'PY'
import bisect, re, struct, sys

def load(path):
    try:
        return sorted((int(l.split()[0], 16), l.split()[2]) for l in open(path) if len(l.split()) >= 3)
    except OSError:
        return None

def name(syms, rip):
    if not syms:
        return "?"
    i = bisect.bisect_right([a for a, _ in syms], rip) - 1
    if i < 0 or rip - syms[i][0] > 0x10000:
        return "-"
    return "%s+%#x" % (syms[i][1], rip - syms[i][0])

def elf_bytes(path, vaddr, n):
    """n bytes of the ELF file at virtual address vaddr (PT_LOAD), or None."""
    try:
        f = open(path, "rb")
    except OSError:
        return None
    h = f.read(64)
    if h[:4] != b"\x7fELF" or h[4] != 2:
        return None
    phoff, = struct.unpack_from("<Q", h, 32)
    phentsize, phnum = struct.unpack_from("<HH", h, 54)
    for i in range(phnum):
        f.seek(phoff + i * phentsize)
        ty, _fl, off, va, _pa, filesz = struct.unpack("<IIQQQQ", f.read(40))
        if ty == 1 and va <= vaddr and vaddr + n <= va + filesz:
            f.seek(off + vaddr - va)
            return f.read(n)
    return None

dump = open(sys.argv[1], errors="replace").read().replace("\r", "")
guest, vmlinux = load(sys.argv[2]), sys.argv[3]
for addr, hexes in re.findall(r"^([0-9a-f]{16}): ((?:0x[0-9a-f]{2} ?)+)$", dump, re.M):
    rip = int(addr, 16)
    got = bytes(int(b, 16) for b in hexes.split())
    want = elf_bytes(vmlinux, rip, len(got)) if vmlinux else None
    if want is None:
        whose = "not in the guest kernel's image"
    elif want == got:
        whose = "the guest kernel's own code (a Sprout guest was running)"
    else:
        whose = "the bytes QEMU read there are not the guest kernel's (the lab kernel's code, a guest's user space, or memory read through a nested guest's page tables as if they were the lab's)"
    print("emulated CPU at %#x: %s (guest kernel symbol there: %s)" % (rip, whose, name(guest, rip)))
# QEMU reads memory through the CPU's CR3 as if it were the lab's own page
# table: in a nested guest (whose CR3 is a guest-physical address) it
# cannot, which itself says the CPU was not in the lab's kernel.
for addr in re.findall(r"^([0-9a-f]{16}): Cannot access memory", dump, re.M):
    rip = int(addr, 16)
    print("emulated CPU at %#x: its page tables are not the lab kernel's (QEMU cannot read its code through them: "
          "a nested guest was running); guest kernel symbol there: %s" % (rip, name(guest, rip)))
PY
}

# Says so if QEMU's monitor output $1 ("info lapic") shows the lab kernel's
# timer interrupt lost (see --tick): the local timer's vector waiting in the
# IRR, nothing in service, the timer spent.
lost_timer() {
  tr -d '\r' <"$1" | awk -v tick="$tick" '
    /^dumping local APIC state for CPU/ { cpu = $NF; timer = 0; irr = 0; isr = 0 }
    /^LVTT/ && /one-shot/ && !/masked/ && match($0, /vec [0-9]+/) { vec = substr($0, RSTART + 4, RLENGTH - 4); timer = 1 }
    /^Timer/ && /current_count = 0$/ { spent = 1 }
    /^ISR/ && /\(none\)/ { isr = 1 }
    /^IRR/ { for (i = 2; i <= NF; i++) if ($i == vec) irr = 1
             if (timer && spent && isr && irr && !said[cpu]++)
               printf "CPU %s: the lab kernel'"'"'s timer interrupt (vector %s) waits in its local APIC while the one-shot timer is spent: QEMU lost it (the race described at run.sh --tick; this run'"'"'s tick: %s)\n", cpu, vec, tick
             spent = 0 }'
}

froze=0
last_beats=0
quiet=0
while kill -0 "$qemu" 2>/dev/null; do
  sleep 5
  beats=$(grep -c 'SPROUT-LAB-HEARTBEAT' "$console" 2>/dev/null || true)
  if [ "$beats" != "$last_beats" ]; then
    last_beats=$beats
    quiet=0
    continue
  fi
  # The heartbeat starts with the test script: before it, boot time counts too.
  quiet=$((quiet + 5))
  if [ "$quiet" -ge "$stall" ]; then
    froze=1
    say "no heartbeat from the lab's kernel for ${quiet} s (host time): the emulated machine froze; QEMU's view:"
    for round in 1 2; do
      echo "info cpus" >&8
      echo "info registers -a" >&8
      sleep 2
    done
    for c in $(seq 0 $((smp - 1))); do
      echo "cpu $c" >&8
      echo 'x /16xb $pc' >&8
      # The lab kernel's own local APIC: its timer (armed or spent) and
      # what is pending (IRR) or in service (ISR), to tell an interrupt
      # QEMU holds back from one that was never raised.
      echo "info lapic" >&8
    done
    sleep 1
    tr -d '\r' <"$tmp/monitor.log" | grep -E '^\*? *CPU #|^RIP=|^RAX=|^CR0=|^EFL|^CS ' >&2 || true
    tr -d '\r' <"$tmp/monitor.log" | grep -E '^(dumping local APIC|LVTT|Timer|ISR|IRR|APR)' >&2 || true
    lost_timer "$tmp/monitor.log" >&2 || true
    where_cpus_were "$tmp/monitor.log" >&2 || true
    [ -n "$log" ] && cp "$tmp/monitor.log" "$log.monitor"
    kill "$qemu" 2>/dev/null
    break
  fi
done
wait "$qemu"
qemu_status=$?
exec 8>&-
kill "$monitor_reader" 2>/dev/null
set -e
say "outer VM ran ${SECONDS} s (host time)"
[ -n "$log" ] && [ -f "$tmp/qemu.log" ] && cp "$tmp/qemu.log" "$log.qemu"

tr -d '\r' <"$console" >"$tmp/console.txt"
# (The outer console may put terminal escapes before a marker.)
status=$(sed -n 's/^.*===SPROUT-LAB-EXIT \([0-9]*\)===$/\1/p' "$tmp/console.txt" | tail -1)
# The script's output: everything between the markers.
sed -n '/===SPROUT-LAB-BEGIN===$/,/===SPROUT-LAB-EXIT [0-9]*===$/p' "$tmp/console.txt" | sed '1d;$d' |
  grep -v '===SPROUT-LAB-HEARTBEAT' || true
if [ "$froze" = 1 ] && [ -z "$status" ]; then
  say "the emulated machine froze (no heartbeat for $stall s); console tail:"
  grep -v '===SPROUT-LAB-HEARTBEAT' "$tmp/console.txt" | tail -n 40 >&2
  exit 127
fi
if [ -z "$status" ]; then
  if [ "$qemu_status" = 124 ] || [ "$qemu_status" = 137 ]; then
    say "timed out after $timeout s (host time); console:"
    cat "$tmp/console.txt" >&2
    exit 124
  fi
  if grep -q 'Kernel panic - not syncing' "$tmp/console.txt"; then
    # The outer kernel's own panic (its KVM, under QEMU's emulation of SVM):
    # a failure of the emulated machine, which no program of Sprout's can
    # cause in a correct kernel.
    say "the lab's own kernel panicked (a failure of the emulated machine, not of a Sprout guest):"
    grep -m 8 -E 'BUG:|Oops|Comm:|RIP:|Kernel panic' "$tmp/console.txt" >&2 || true
    say "console:"
    cat "$tmp/console.txt" >&2
    exit 126
  fi
  if grep -q 'soft lockup' "$tmp/console.txt"; then
    say "the lab's own kernel locked up (soft lockup: a failure of the emulated machine); console:"
    cat "$tmp/console.txt" >&2
    exit 126
  fi
  if grep -q '^Triple fault' "$tmp/qemu.log" 2>/dev/null; then
    # QEMU (-d guest_errors) saw the outer machine triple-fault, and
    # -no-reboot ended it: the lab's own kernel lost its stack or IDT, a
    # failure of the emulated machine (its kernel's KVM under QEMU's nested
    # SVM), not of a Sprout guest, whose triple fault ends only its VM.
    say "the emulated machine triple-faulted (its own kernel: a failure of the emulated machine, not of a Sprout guest); console:"
    cat "$tmp/console.txt" >&2
    exit 126
  fi
  # QEMU logs every CPU reset (-d cpu_reset): CPU 0 twice at power-on (other CPUs
  # also at their INIT from the kernel); more of CPU 0 is the
  # emulated machine resetting itself (a triple fault, or a panic rebooting).
  resets=$(grep -c '^CPU Reset (CPU 0)' "$tmp/qemu.log" 2>/dev/null || true)
  if [ "${resets:-0}" -gt 2 ]; then
    say "the emulated machine reset itself (a triple fault or a panic of the lab's kernel); QEMU's CPU state at the reset:"
    grep -A12 '^CPU Reset' "$tmp/qemu.log" | tail -n 13 >&2
  fi
  say "the lab ended without its exit marker (QEMU status $qemu_status); console:"
  cat "$tmp/console.txt" >&2
  exit 125
fi
exit "$status"
