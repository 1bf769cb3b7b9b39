#!/usr/bin/env bash
# Pull-and-convert time of an OCI image (issue 16), on this host: an image of
# about 100 MiB (busybox, 96 MiB of incompressible data in 4 files over two
# layers, and 2000 small files), built with umoci, pushed with skopeo to
# Debian's docker-registry on loopback, then `sprout image pull` (release):
#   cold       a fresh cache each run: manifest, every blob over HTTP,
#              gunzip + unpack, Sprout's files, mkfs.ext4 -d
#   blobs      blobs cached, no base image: unpack and mkfs only (what a new
#              agent costs an image already pulled)
#   cached     by tag: one manifest request, nothing else
#   digest     by digest: no request at all
# Prints a Markdown table and one JSON line a row
# ({"name","runs","p50_ms","p99_ms","min_ms","max_ms"}).
#
# Usage: tests/oci/bench-pull.sh [RUNS]   (default 10; cached rows run 5x as often)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
runs=${1:-10}
say() { printf '[bench-pull %s] %s\n' "$(date +%T)" "$*" >&2; }

"$here/install.sh"
say "building sprout (release)"
(cd "$root" && cargo build --release --locked -q -p service --bin sprout)
sprout=${CARGO_TARGET_DIR:-$root/target}/release/sprout
agent=${SPROUT_AGENT:-${SPROUT_CACHE:-$HOME/.cache/sprout}/images/.sprout-agent.stripped}
[ -f "$agent" ] || "$root/guest/build-images.sh" test >/dev/null

tmp=$(mktemp -d)
registry=
cleanup() {
  if [ -n "$registry" ]; then kill "$registry" 2>/dev/null; wait "$registry" 2>/dev/null || true; fi
  rm -rf "$tmp"
}
trap cleanup EXIT

say "building the image"
umoci init --layout "$tmp/layout"
umoci new --image "$tmp/layout:1"
umoci unpack --image "$tmp/layout:1" "$tmp/b" >/dev/null
mkdir -p "$tmp/b/rootfs/bin" "$tmp/b/rootfs/data/small"
cp /bin/busybox "$tmp/b/rootfs/bin/busybox"
ln -s busybox "$tmp/b/rootfs/bin/sh"
for i in 1 2; do head -c $((24 << 20)) /dev/urandom >"$tmp/b/rootfs/data/blob$i"; done
for i in $(seq 2000); do echo "file $i" >"$tmp/b/rootfs/data/small/$i"; done
umoci repack --image "$tmp/layout:1" "$tmp/b"
rm -rf "$tmp/b"
umoci unpack --image "$tmp/layout:1" "$tmp/b" >/dev/null
for i in 3 4; do head -c $((24 << 20)) /dev/urandom >"$tmp/b/rootfs/data/blob$i"; done
umoci repack --image "$tmp/layout:1" "$tmp/b"
rm -rf "$tmp/b"

port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
cat >"$tmp/registry.yml" <<EOF
version: 0.1
log:
  level: warn
  accesslog:
    disabled: true
storage:
  filesystem:
    rootdirectory: $tmp/storage
http:
  addr: 127.0.0.1:$port
EOF
docker-registry serve "$tmp/registry.yml" >"$tmp/registry.log" 2>&1 &
registry=$!
for _ in $(seq 200); do curl -sf "http://127.0.0.1:$port/v2/" >/dev/null && break; sleep 0.05; done
skopeo copy --quiet --dest-tls-verify=false "oci:$tmp/layout:1" "docker://127.0.0.1:$port/bench/img:1"
ref=127.0.0.1:$port/bench/img:1
digest=$(SPROUT_CACHE=$tmp/probe SPROUT_AGENT=$agent "$sprout" image pull --json "$ref" 2>/dev/null |
  python3 -c 'import json,sys; print(json.load(sys.stdin)["digest"])')
size=$(du -sh --apparent-size "$tmp/storage" | cut -f1)
say "image $digest, registry storage $size"

# Microseconds (bash's own clock: no process started to read it).
ms() { echo "${EPOCHREALTIME/./}"; }
# time_pull NAME CACHE REF: one timed pull (microseconds) to $tmp/NAME.times
time_pull() {
  local t0 t1
  t0=$(ms)
  SPROUT_CACHE=$2 SPROUT_AGENT=$agent "$sprout" image pull "$3" >/dev/null 2>"$tmp/last.err" ||
    { cat "$tmp/last.err" >&2; exit 1; }
  t1=$(ms)
  echo $((t1 - t0)) >>"$tmp/$1.times"
}

say "cold: $runs runs"
for i in $(seq "$runs"); do
  rm -rf "$tmp/cold"
  sync
  time_pull cold "$tmp/cold" "$ref"
done
say "blobs cached, base image not: $runs runs"
for i in $(seq "$runs"); do
  rm -rf "$tmp/cold/oci/images"
  time_pull blobs "$tmp/cold" "$ref"
done
say "cached: $((runs * 5)) runs each by tag and by digest"
for i in $(seq $((runs * 5))); do
  time_pull cached "$tmp/cold" "$ref"
  time_pull digest "$tmp/cold" "127.0.0.1:$port/bench/img@$digest"
done

python3 - "$tmp" <<'EOF'
import json, sys
tmp = sys.argv[1]
rows = [("pull cold (~100 MiB, 2 layers)", "cold"), ("unpack + mkfs (blobs cached)", "blobs"),
        ("pull cached, by tag (1 manifest request)", "cached"), ("pull cached, by digest (no request)", "digest")]
print("| what | runs | p50 ms | p99 ms | min ms | max ms |")
print("| --- | --- | --- | --- | --- | --- |")
lines = []
for name, f in rows:
    v = sorted(int(x) / 1000 for x in open(f"{tmp}/{f}.times"))
    n = len(v)
    q = lambda p: v[min(n - 1, int(round(p * (n - 1))))]
    r = {"name": f"oci {f}", "runs": n, "p50_ms": round(q(0.5), 1), "p99_ms": round(q(0.99), 1),
         "min_ms": round(v[0], 1), "max_ms": round(v[-1], 1)}
    print(f"| {name} | {n} | {r['p50_ms']} | {r['p99_ms']} | {r['min_ms']} | {r['max_ms']} |")
    lines.append(json.dumps(r))
print("\n".join(lines))
EOF
