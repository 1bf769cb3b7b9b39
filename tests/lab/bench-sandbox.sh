#!/usr/bin/env bash
# Restore and fork of a Linux guest, measured in the emulated lab (QEMU TCG +
# nested SVM: EMULATED hardware virtualization, so these numbers are NOT what a
# hardware-virtualization host gives; they show trends and ratios only).
#
# Usage: tests/lab/bench-sandbox.sh [RUNS]   (default 20 per row)
# A parent (test image, 1 vCPU, 256 MiB) boots, runs for a few seconds and is
# snapshotted. Then, RUNS times each:
#   restore (mmap, uffd): `sprout vm restore SNAP --exec true`, timed by sprout
#     from the start of the restore: VM running, agent answering, identity
#     refreshed, first command ended;
#   fork(1), fork(4) of the running parent: the parent's sprout times the fork
#     request to children running and to children re-identified; the lab's
#     clock (adjtimex, microseconds) times the request to every child having
#     answered one `sprout vm exec --exec true`.
# Prints p50/p99/min/max in milliseconds per row.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
runs=${1:-20}
say() { printf '[bench-sandbox %s] %s\n' "$(date +%T)" "$*" >&2; }

# This checkout's lab, whatever <cache>/lab names by the time it runs.
SPROUT_LAB=$("$here/build.sh" | tail -n 1)
export SPROUT_LAB
script=$(mktemp)
out=$(mktemp)
trap 'rm -f "$script" "$out"' EXIT
cat >"$script" <<EOS
now_us() { adjtimex | awk '/tv_sec/{s=\$2} /tv_usec/{u=\$2} END{printf "%d%06d\n", s, u}'; }
RUST_LOG=service=info sprout vm run --image test --cpus 1 --memory-mib 256 --api-sock /tmp/p.sock >/tmp/p.log 2>&1 &
sprout vm exec --api-sock /tmp/p.sock --exec true || exit 10
sleep 3
sprout vm snapshot --api-sock /tmp/p.sock --out /tmp/snap >/dev/null || exit 11
for b in mmap uffd; do
  i=0
  while [ \$i -lt $runs ]; do
    RUST_LOG=service::linux=info sprout vm restore /tmp/snap --memory-backend \$b --exec true 2>&1 |
      sed -n "s/.*restored \([0-9]*\) us after start.*/restore_\${b}_running \1/p
              s/.*agent ready \([0-9]*\) us after start.*/restore_\${b}_agent \1/p
              s/.*identity refreshed \([0-9]*\) us after start.*/restore_\${b}_identity \1/p
              s/.*command ended \([0-9]*\) us after start.*/restore_\${b}_exec \1/p"
    i=\$((i + 1))
  done
done
for n in 1 4; do
  i=0
  while [ \$i -lt $runs ]; do
    t0=\$(now_us)
    # Children are worker processes now: the forking sprout logs the times.
    RUST_LOG=service::control=info sprout vm fork --api-sock /tmp/p.sock --count \$n >/tmp/kids 2>>/tmp/fork.log || exit 12
    for k in \$(cat /tmp/kids); do sprout vm exec --api-sock \$k --exec true || exit 13; done
    t1=\$(now_us)
    echo "fork\${n}_all_exec \$((t1 - t0))"
    for k in \$(cat /tmp/kids); do sprout vm ctl --api-sock \$k stop >/dev/null; done
    i=\$((i + 1))
  done
done
sed -n 's/.*fork(\([0-9]*\)): children running \([0-9]*\) us.*/fork\1_running \2/p
        s/.*fork(\([0-9]*\)): children re-identified \([0-9]*\) us.*/fork\1_identity \2/p' /tmp/fork.log
sprout vm ctl --api-sock /tmp/p.sock stop >/dev/null
wait
EOS
say "$runs runs per row in the lab (test image, 1 vCPU, 256 MiB)"
SECONDS=0
"$here/run.sh" --timeout $((300 + runs * 60)) "$script" >"$out"
say "lab run took $SECONDS s of host time"
echo "restore and fork of a Linux guest, EMULATED hardware virtualization (QEMU TCG, nested SVM)"
for row in restore_mmap_running restore_mmap_agent restore_mmap_identity restore_mmap_exec \
           restore_uffd_running restore_uffd_agent restore_uffd_identity restore_uffd_exec \
           fork1_running fork1_identity fork1_all_exec fork4_running fork4_identity fork4_all_exec; do
  grep "^$row " "$out" | cut -d' ' -f2 | sort -n | awk -v row="$row" '
    { v[NR] = $1 / 1000 }
    function pct(p,   i) { i = int((p / 100) * NR + 0.999999); if (i < 1) i = 1; if (i > NR) i = NR; return v[i] }
    END {
      if (NR == 0) { printf "  %-24s no samples\n", row; exit }
      printf "  %-24s n %3d  p50 %7.1f ms  p99 %7.1f ms  min %7.1f ms  max %7.1f ms\n", row, NR, pct(50), pct(99), v[1], v[NR]
    }'
done
