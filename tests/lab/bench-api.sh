#!/usr/bin/env bash
# sproutd's API beside the library (issue 11), in the emulated lab (QEMU TCG +
# nested SVM: EMULATED hardware virtualization, so the numbers are NOT what a
# hardware-virtualization host gives; compare the rows of one run).
#
# Usage: tests/lab/bench-api.sh [RUNS]   (default 200)
# 1. In the lab: `sprout daemon` on the lab's loopback, and `report api`
#    (benches/src/bin/report/api.rs) beside it: a no-op request, a buffered
#    exec of `true` through the API and through the agent's own client on the
#    same sandbox, and create to first exec.
# 2. On this host: `sproutd --lab` (the lab-hosted mode) and `report api`
#    through its forwarded port: what a client on this host gets.
# Prints both tables (and their JSON lines).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
runs=${1:-200}
say() { printf '[bench-api %s] %s\n' "$(date +%T)" "$*" >&2; }

lab=$("$here/build.sh" | tail -n 1)
say "building report and sproutd (release)"
(cd "$root" && cargo build --release --locked -q -p sprout-benches --bin report -p service --bin sproutd)
target=${CARGO_TARGET_DIR:-$root/target}
tmp=$(mktemp -d)
daemon=
cleanup() {
  if [ -n "$daemon" ]; then
    kill "$daemon" 2>/dev/null || true
    wait "$daemon" 2>/dev/null || true
  fi
  rm -rf "$tmp"
}
trap cleanup EXIT
cp "$target/release/report" "$tmp/report"

say "1/2: in the lab, $runs runs a row"
cat >"$tmp/script.sh" <<EOS
ip link set lo up
sprout daemon --no-lab --listen 127.0.0.1:7070 --data-dir /tmp/sd >/tmp/sd.out 2>/tmp/sd.log &
daemon_pid=\$!
i=0
until sprout api GET /v1/health >/dev/null 2>&1; do
  i=\$((i+1)); [ \$i -gt 600 ] && { cat /tmp/sd.log; exit 10; }
  sleep 0.1
done
/lab/report api http://127.0.0.1:7070 --data-dir /tmp/sd --label "ready workers" $runs --json || { tail -n 30 /tmp/sd.log; exit 11; }
kill -INT \$daemon_pid 2>/dev/null; wait \$daemon_pid 2>/dev/null
# The same with no ready workers: each restore starts its worker process.
sprout daemon --no-lab --listen 127.0.0.1:7071 --data-dir /tmp/sd0 --ready-workers 0 >/tmp/sd0.out 2>/tmp/sd0.log &
i=0
until sprout api --addr 127.0.0.1:7071 GET /v1/health >/dev/null 2>&1; do
  i=\$((i+1)); [ \$i -gt 600 ] && { cat /tmp/sd0.log; exit 12; }
  sleep 0.1
done
/lab/report api http://127.0.0.1:7071 --data-dir /tmp/sd0 --label "no ready workers" $runs --json || { tail -n 30 /tmp/sd0.log; exit 13; }
EOS
SPROUT_LAB=$lab "$here/run.sh" --timeout 3600 "$tmp/script.sh" "$tmp/report"

say "2/2: on this host through sproutd --lab's forwarded port, $runs runs a row"
SPROUT_LAB=$lab "$target/release/sproutd" --lab --listen 127.0.0.1:0 --data-dir "$tmp/data" \
  >"$tmp/sproutd.out" 2>"$tmp/sproutd.log" &
daemon=$!
i=0
until grep -q '^sproutd listening on ' "$tmp/sproutd.out"; do
  i=$((i + 1))
  if [ $i -gt 3000 ] || ! kill -0 "$daemon" 2>/dev/null; then
    cat "$tmp/sproutd.log" >&2
    exit 1
  fi
  sleep 0.2
done
url=$(sed -n 's/^sproutd listening on //p' "$tmp/sproutd.out")
"$target/release/report" api "$url" --label "from this host" "$runs" --json
kill -INT "$daemon"
wait "$daemon" || true
daemon=
