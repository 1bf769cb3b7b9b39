#!/usr/bin/env bash
# Boot-to-agent-ready latency of a Linux guest, measured in the emulated lab
# (QEMU TCG + nested SVM: EMULATED hardware virtualization, so these numbers
# are NOT what a hardware-virtualization host gives; they show trends only).
#
# Usage: tests/lab/bench-boot.sh [BOOTS] [IMAGE]   (default: 12 boots, test image)
# Each boot: sprout vm run --image IMAGE --cpus 1 --memory-mib 256 --exec true,
# timed by sprout from Vm::start to the agent's first answer (the "agent ready"
# log line), on the outer VM's clock, which is checked against host time.
# Prints p50/p90/p99/min/max in milliseconds.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
boots=${1:-12}
image=${2:-test}
say() { printf '[bench-boot %s] %s\n' "$(date +%T)" "$*" >&2; }

"$here/build.sh" >/dev/null
script=$(mktemp)
out=$(mktemp)
trap 'rm -f "$script" "$out"' EXIT
cat >"$script" <<EOS
start=\$(date +%s)
i=0
while [ \$i -lt $boots ]; do
  RUST_LOG=service::linux=info sprout vm run --image $image --cpus 1 --memory-mib 256 --exec true 2>&1 |
    sed -n 's/.*agent ready \([0-9]*\) us after start.*/ready_us \1/p'
  i=\$((i + 1))
done
echo "lab_clock_s \$((\$(date +%s) - start))"
EOS
say "$boots boots of the $image image in the lab (1 vCPU, 256 MiB)"
SECONDS=0
"$here/run.sh" --timeout $((120 + boots * 120)) "$script" >"$out"
host_s=$SECONDS
n=$(grep -c '^ready_us ' "$out" || true)
[ "$n" = "$boots" ] || { cat "$out" >&2; say "error: $n of $boots boots reported agent ready"; exit 1; }
lab_s=$(sed -n 's/^lab_clock_s //p' "$out")
grep '^ready_us ' "$out" | cut -d' ' -f2 | sort -n | awk -v host="$host_s" -v lab="$lab_s" '
  { v[NR] = $1 / 1000 }
  function pct(p,   i) { i = int((p / 100) * NR + 0.999999); if (i < 1) i = 1; if (i > NR) i = NR; return v[i] }
  END {
    printf "boot to agent ready, EMULATED hardware virtualization (QEMU TCG, nested SVM), %d boots\n", NR
    printf "  p50 %.0f ms  p90 %.0f ms  p99 %.0f ms  min %.0f ms  max %.0f ms\n", pct(50), pct(90), pct(99), v[1], v[NR]
    printf "  clock check: the boots took %s s on the lab clock; the whole lab run %s s of host time (outer boot included)\n", lab, host
  }'
