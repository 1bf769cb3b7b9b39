#!/usr/bin/env bash
# A sandbox's network (issue 17), in the emulated lab (QEMU TCG + nested SVM:
# EMULATED hardware virtualization and an emulated CPU under every packet, so
# the numbers are NOT what a hardware-virtualization host gives; compare the
# rows of one run).
#
# Usage: tests/lab/bench-net.sh [RUNS]   (default 100)
# In the lab: a web server in a namespace of its own (the internet's
# stand-in, one routed hop from the host), `sprout daemon`, one sandbox of
# the default image; in the guest, Python times RUNS HTTP GETs of a small
# page (a new TCP connection each: connect, request, answer, through the
# guest's virtio-net, its TAP, the veth pair and NAT) and five 32 MiB
# downloads (throughput). Prints a Markdown table and JSON lines
# ({"name", "runs", "p50_ms", "p99_ms", "min_ms", "max_ms"}; throughput
# rows have "mb_per_s" instead).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
runs=${1:-100}
say() { printf '[bench-net %s] %s\n' "$(date +%T)" "$*" >&2; }

lab=$("$here/build.sh" | tail -n 1)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# What the guest runs (fed on its stdin).
cat >"$tmp/bench.py" <<'EOF'
import json, sys, time, urllib.request
url, runs = sys.argv[1], int(sys.argv[2])
def row(name, ms):
    ms.sort()
    print("bench-row " + json.dumps({"name": name, "runs": len(ms),
        "p50_ms": round(ms[len(ms) // 2], 3),
        "p99_ms": round(ms[min(len(ms) - 1, int(len(ms) * 0.99))], 3),
        "min_ms": round(ms[0], 3), "max_ms": round(ms[-1], 3)}))
ms = []
for _ in range(runs):
    t = time.perf_counter()
    urllib.request.urlopen(url + "index.html", timeout=30).read()
    ms.append((time.perf_counter() - t) * 1000)
row("sandbox: HTTP GET of a small page outside (new connection)", ms)
rates = []
for _ in range(5):
    t = time.perf_counter()
    n = len(urllib.request.urlopen(url + "big", timeout=600).read())
    rates.append(n / (time.perf_counter() - t) / 1e6)
rates.sort()
print("bench-row " + json.dumps({"name": "sandbox: 32 MiB download from outside",
    "runs": len(rates), "mb_per_s": round(rates[len(rates) // 2], 2),
    "min_mb_per_s": round(rates[0], 2), "max_mb_per_s": round(rates[-1], 2)}))
EOF
py=$(sed 's/\\/\\\\/g; s/"/\\"/g' "$tmp/bench.py" | awk '{ printf "%s\\n", $0 }')

cat >"$tmp/script.sh" <<EOS
# iproute2's ip (busybox sh runs its own applet for a bare `ip`).
ip() { /usr/sbin/ip "\$@"; }
ip link set lo up
ip netns add inet
ip link add inet-h type veth peer name eth0 netns inet
ip addr add 198.51.100.1/24 dev inet-h && ip link set inet-h up
ip -n inet link set lo up
ip -n inet addr add 198.51.100.2/24 dev eth0 && ip -n inet link set eth0 up
mkdir -p /srv/www
echo "hello from outside" >/srv/www/index.html
head -c 33554432 /dev/zero >/srv/www/big
ip netns exec inet busybox httpd -p 80 -h /srv/www
sprout daemon --no-lab --listen 127.0.0.1:7070 --data-dir /tmp/sd --no-templates >/tmp/sd.out 2>/tmp/sd.log &
i=0
until sprout api GET /v1/health >/dev/null 2>&1; do
  i=\$((i+1)); [ \$i -gt 600 ] && { cat /tmp/sd.log; exit 10; }
  sleep 0.1
done
out=\$(sprout api POST /v1/runtime/schedule '{"cpus":1,"memoryMb":256}') || { echo "\$out"; tail -30 /tmp/sd.log; exit 11; }
id=\$(echo "\$out" | sed -n 's/.*"vmId":"\([^"]*\)".*/\1/p')
sprout api POST /v1/runtime/vms/\$id/exec '{"command":"python3","argv":["-","http://198.51.100.2/","$runs"],"timeoutMs":3600000,"stdin":"$py"}' >/tmp/bench.json
sed -n 's/.*"stdout":"\(.*\)","stderr".*/\1/p' /tmp/bench.json | sed 's/\\\\n/\n/g; s/\\\\"/"/g' | grep '^bench-row ' || { cat /tmp/bench.json; exit 12; }
EOS
say "in the lab: $runs GETs and five 32 MiB downloads from a sandbox"
SPROUT_LAB=$lab "$here/run.sh" --timeout 3600 "$tmp/script.sh" | tee "$tmp/out" >&2
echo
echo "| what (emulated lab) | runs | p50 | p99 | min | max |"
echo "| --- | --- | --- | --- | --- | --- |"
sed -n 's/.*bench-row //p' "$tmp/out" | while read -r j; do
  name=$(echo "$j" | sed -n 's/.*"name": "\([^"]*\)".*/\1/p')
  if echo "$j" | grep -q mb_per_s; then
    v() { echo "$j" | sed -n "s/.*\"$1\": \([0-9.]*\).*/\1/p"; }
    echo "| $name | $(v runs) | $(v mb_per_s) MB/s | | $(v min_mb_per_s) MB/s | $(v max_mb_per_s) MB/s |"
  else
    v() { echo "$j" | sed -n "s/.*\"$1\": \([0-9.]*\).*/\1/p"; }
    echo "| $name | $(v runs) | $(v p50_ms) ms | $(v p99_ms) ms | $(v min_ms) ms | $(v max_ms) ms |"
  fi
done
echo
sed -n 's/.*bench-row //p' "$tmp/out"
