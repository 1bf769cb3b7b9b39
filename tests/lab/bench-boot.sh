#!/usr/bin/env bash
# Boot-to-agent-ready latency of a Linux guest, measured in the emulated lab
# (QEMU TCG + nested SVM: EMULATED hardware virtualization, so these numbers
# are NOT what a hardware-virtualization host gives; they show trends only).
#
# Usage: tests/lab/bench-boot.sh [BOOTS] [IMAGE]   (default: 12 boots, test image)
# Each boot: sprout vm run --image IMAGE --cpus 1 --memory-mib 256 --exec true,
# timed by sprout per phase (its log lines: process main to VM start, the
# configuration's probe and writable disk (an empty top over the template),
# each step of Vm::create, VM start to the agent's first answer), on the outer VM's clock, which is checked against
# host time. Prints p50/p90/p99/min/max of each phase in milliseconds and the
# phases of every boot over 3x the p50 to agent ready.
# SCRUB=1 (the default) writes and frees 128 MiB of tmpfs in the lab before
# each boot: Linux hands the next VM the pages the last VM's guest ran from,
# and under QEMU TCG the first write to each is slow (likely the translated
# code it drops), so without the scrub the kernel load of a boot after a boot
# measures the emulator (~250 ms more in the lab, none on hardware; see
# docs/benchmarks.md). SCRUB=0 boots back to back.
# DISK=both alternates the writable disk between an empty top over the
# template (the default) and a whole copy of it (`--disk NEW`), one table each.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
boots=${1:-12}
image=${2:-test}
disk=${DISK:-top}
scrub=${SCRUB:-1}
case $scrub in 0 | 1) ;; *) echo "SCRUB is 0 or 1" >&2; exit 2 ;; esac
case $disk in top | both) ;; *) echo "DISK is top or both" >&2; exit 2 ;; esac
say() { printf '[bench-boot %s] %s\n' "$(date +%T)" "$*" >&2; }

# This checkout's lab, whatever <cache>/lab names by the time it runs.
SPROUT_LAB=$("$here/build.sh" | tail -n 1)
export SPROUT_LAB
script=$(mktemp)
out=$(mktemp)
trap 'rm -f "$script" "$out"' EXIT
cat >"$script" <<EOS
start=\$(date +%s)
i=0
while [ \$i -lt $boots ]; do
  mode=top; args=
  if [ $disk = both ] && [ \$((i % 2)) = 1 ]; then
    mode=copy; rm -f /tmp/bench-disk.ext4; args="--disk /tmp/bench-disk.ext4"
  fi
  if [ $scrub = 1 ]; then
    dd if=/dev/zero of=/tmp/bench-scrub bs=1M count=128 2>/dev/null; rm -f /tmp/bench-scrub
  fi
  # One line per boot: every phase sprout logs (service::linux, vmm::create).
  RUST_LOG=service::linux=debug,vmm::create=debug sprout vm run --image $image --cpus 1 --memory-mib 256 \$args --exec true 2>&1 |
    sed -n -e 's/.*KVM probe (or its kept verdict): \([0-9]*\) us.*/probe_us=\1/p' \
      -e 's/.*writable disk.*the template: \([0-9]*\) us.*/disk_us=\1/p' \
      -e 's/.*vm created: \(.*\)/\1/p' \
      -e 's/.*vm started \([0-9]*\) us after main: config \([0-9]*\) us.*before the configuration \([0-9]*\) us, \([0-9]*\) minor.*/main_to_start_us=\1 config_us=\2 pre_us=\3 process_faults=\4/p' \
      -e 's/.*agent ready \([0-9]*\) us after start.*/ready_us=\1/p' | tr '\n' ' ' | sed "s/^/boot mode=\$mode /; s/\\\$/\\n/"
  i=\$((i + 1))
done
echo "lab_clock_s \$((\$(date +%s) - start))"
EOS
say "$boots boots of the $image image in the lab (1 vCPU, 256 MiB)"
SECONDS=0
"$here/run.sh" --timeout $((120 + boots * 120)) "$script" >"$out"
host_s=$SECONDS
n=$(grep -c '^boot .*ready_us=' "$out" || true)
[ "$n" = "$boots" ] || { cat "$out" >&2; say "error: $n of $boots boots reported agent ready"; exit 1; }
lab_s=$(sed -n 's/^lab_clock_s //p' "$out")
python3 - "$out" "$host_s" "$lab_s" "$scrub" <<'PY'
import re, sys
every = []
for line in open(sys.argv[1]):
    if line.startswith("boot "):
        b = {k: int(v) / 1000 for k, v in re.findall(r"(\w+)_us=(\d+)", line)}
        b.update({k + "_faults": int(v) for k, v in re.findall(r"(\w+)_faults=(\d+)", line)})
        b["mode"] = re.search(r"mode=(\w+)", line).group(1)
        every.append(b)

def pct(v, p):
    v = sorted(v)
    return v[min(len(v) - 1, max(0, int(p / 100 * len(v) + 0.999999) - 1))]

keys = ["main_to_start", "pre", "config", "probe", "disk", "total", "kvm", "memory", "kernel", "devices", "vcpus", "threads", "ready"]
names = {"main_to_start": "process main to VM start", "pre": "process main to configuration (arguments, logger)",
         "config": "configuration (probe, disk)",
         "probe": "KVM probe (or kept verdict)", "disk": "writable disk", "total": "Vm::create",
         "ready": "Vm::start called to agent ready (Vm::create included)"}
for mode in ["top", "copy"]:
    boots = [b for b in every if b["mode"] == mode]
    if not boots:
        continue
    what = "an empty top over the template" if mode == "top" else "a whole copy of the template (--disk NEW)"
    print("boot phases in ms, EMULATED hardware virtualization (QEMU TCG, nested SVM), %d boots, writable disk: %s" % (len(boots), what))
    print("| phase | p50 | p90 | p99 | min | max |")
    print("| --- | --- | --- | --- | --- | --- |")
    for k in keys:
        v = [b[k] for b in boots if k in b]
        if v:
            print("| %s | %.1f | %.1f | %.1f | %.1f | %.1f |" % (names.get(k, "create: " + k), pct(v, 50), pct(v, 90), pct(v, 99), min(v), max(v)))
    faults = [(k[:-len("_faults")], pct([b[k] for b in boots if k in b], 50)) for k in sorted({k for b in boots for k in b if k.endswith("_faults")})]
    print("minor page faults, p50: " + ", ".join("%s %d" % f for f in faults))
boots = every
ready = [b["ready"] for b in boots]
p50 = pct(ready, 50)
slow = [(i, b) for i, b in enumerate(boots) if b["ready"] > 3 * p50]
print("boots over 3x the p50 (%.0f ms) to agent ready: %d" % (p50, len(slow)))
for i, b in slow:
    print("  boot %d: %s" % (i + 1, " ".join("%s=%.0f" % (k, b[k]) for k in keys if k in b)))
print("scrub before each boot: %s" % ("128 MiB of lab tmpfs written and freed" if sys.argv[4] == "1" else "none (back to back)"))
print("clock check: the boots took %s s on the lab clock; the whole lab run %s s of host time (outer boot included)" % (sys.argv[3], sys.argv[2]))
PY
