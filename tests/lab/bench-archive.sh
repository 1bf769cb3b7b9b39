#!/usr/bin/env bash
# Archive and unarchive through sproutd's API (issue 14), of a sandbox with
# 64 MiB of dirty memory and 64 MiB of disk writes: `sproutd --lab` on this
# host with moto's S3 server on this host's loopback (tests/s3/install.sh),
# which the lab reaches through QEMU's forwarding, and `report archive`
# (benches/src/bin/report/archive.rs) through the forwarded port. The lab is
# EMULATED hardware virtualization (QEMU TCG + nested SVM): the numbers are
# NOT what a hardware-virtualization host gives.
#
# Usage: tests/lab/bench-archive.sh [RUNS]   (default 5)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
runs=${1:-5}
say() { printf '[bench-archive %s] %s\n' "$(date +%T)" "$*" >&2; }

lab=$("$here/build.sh" | tail -n 1)
moto=$("$root/tests/s3/install.sh")
say "building report and sproutd (release)"
(cd "$root" && cargo build --release --locked -q -p sprout-benches --bin report -p service --bin sproutd)
target=${CARGO_TARGET_DIR:-$root/target}
tmp=$(mktemp -d)
daemon= s3=
cleanup() {
  for p in $daemon $s3; do
    kill "$p" 2>/dev/null || true
    wait "$p" 2>/dev/null || true
  done
  rm -rf "$tmp"
}
trap cleanup EXIT

"$moto" -H 127.0.0.1 -p 0 >/dev/null 2>"$tmp/moto.log" &
s3=$!
i=0
until grep -q 'Running on http://127.0.0.1:' "$tmp/moto.log"; do
  i=$((i + 1))
  if [ $i -gt 300 ] || ! kill -0 "$s3" 2>/dev/null; then
    cat "$tmp/moto.log" >&2
    exit 1
  fi
  sleep 0.1
done
port=$(sed -n 's/.*Running on http:\/\/127.0.0.1:\([0-9]*\).*/\1/p' "$tmp/moto.log" | head -n 1)
curl -sf -X PUT "http://127.0.0.1:$port/bench" >/dev/null
say "moto's S3 server on 127.0.0.1:$port; starting sproutd --lab"

AWS_ACCESS_KEY_ID=bench AWS_SECRET_ACCESS_KEY=bench SPROUT_LAB=$lab \
  "$target/release/sproutd" --lab --listen 127.0.0.1:0 --data-dir "$tmp/data" \
  --s3-endpoint "http://127.0.0.1:$port" --s3-bucket bench \
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
say "$runs runs through $url"
"$target/release/report" archive "$url" "$runs" --json || {
  tail -n 40 "$tmp/sproutd.log" >&2
  exit 1
}
kill -INT "$daemon"
wait "$daemon" || true
daemon=
