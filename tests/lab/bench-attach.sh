#!/usr/bin/env bash
# What joining a sandbox's network to the host costs a start, in the
# emulated lab (EMULATED hardware virtualization: compare within a run).
#
# Usage: tests/lab/bench-attach.sh
# In the lab: `sprout daemon` (RUST_LOG=service=debug, no templates), 5
# creates (cold boots), 5 sleep/wake cycles of one sandbox (wakes into
# ready workers) and a fork of 3. Prints sproutd's "network attached in N
# ms" and "agent answered in N ms" lines in order, then one JSON line per
# kind ({"name", "runs", "p50_ms", "min_ms", "max_ms"}).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
lab=$("$here/build.sh" | tail -n 1)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

cat >"$tmp/script.sh" <<'EOF'
ip() { /usr/sbin/ip "$@"; }
ip link set lo up
RUST_LOG=service=debug sprout daemon --listen 127.0.0.1:7070 --data-dir /tmp/sd --no-templates >/tmp/sd.out 2>/tmp/sd.log &
i=0
until sprout api GET /v1/health >/dev/null 2>&1; do i=$((i+1)); [ $i -gt 600 ] && exit 10; sleep 0.1; done
for n in 1 2 3 4 5; do
  sprout api POST /v1/runtime/schedule '{"cpus":1,"memoryMb":256}' >/dev/null 2>&1 || exit 11
done
id=$(sprout api GET /v1/runtime/vms 2>/dev/null | grep -o '"vmId":"[^"]*"' | head -1 | cut -d'"' -f4)
for n in 1 2 3 4 5; do
  sprout api POST /v1/runtime/vms/$id/sleep >/dev/null 2>&1 || exit 12
  sprout api POST /v1/runtime/vms/$id/wake >/dev/null 2>&1 || exit 13
done
sprout api POST /v1/runtime/vms/$id/fork '{"count":3}' >/dev/null 2>&1 || exit 14
grep -o 'network attached in [0-9]* ms\|agent answered in [0-9]* ms' /tmp/sd.log | sed 's/^/attach: /'
EOF
SPROUT_LAB=$lab "$here/run.sh" --timeout 1100 "$tmp/script.sh" | tee "$tmp/out" >&2
python3 - "$tmp/out" <<'EOF'
import json, re, sys
rows = {}
for line in open(sys.argv[1]):
    m = re.search(r"attach: (network attached|agent answered) in (\d+) ms", line)
    if m:
        rows.setdefault(m.group(1), []).append(int(m.group(2)))
for name, ms in rows.items():
    s = sorted(ms)
    print(json.dumps({"name": name + " (create, wake, fork child)", "runs": len(s),
                      "p50_ms": s[len(s) // 2], "min_ms": s[0], "max_ms": s[-1]}))
EOF
