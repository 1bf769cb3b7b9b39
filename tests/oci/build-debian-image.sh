#!/usr/bin/env bash
# Builds the OCI image the Debian OCI tests use (service/tests/lab_oci.rs):
# Debian minbase with python3 and systemd (mmdebstrap), one layer, made an
# OCI image layout with umoci, tag 1. Its cmd writes /tmp/main.out (so a
# test sees whether the container runtime started it). Cached by content in
# ${SPROUT_CACHE:-$HOME/.cache/sprout}/oci-debian-<hash>/layout (the hash
# covers this script, the suite and the mirror).
#
# Usage: tests/oci/build-debian-image.sh    prints the layout's path
# Environment: SPROUT_DEBIAN_MIRROR, SPROUT_DEBIAN_SUITE (as
#   guest/build-images.sh).
set -euo pipefail
cache=${SPROUT_CACHE:-$HOME/.cache/sprout}
mirror=${SPROUT_DEBIAN_MIRROR:-http://deb.debian.org/debian}
suite=${SPROUT_DEBIAN_SUITE:-bookworm}
packages=python3,systemd,systemd-sysv
say() { printf '[oci-debian %s] %s\n' "$(date +%T)" "$*" >&2; }
die() { say "error: $*"; exit 1; }
for t in mmdebstrap umoci; do
  command -v "$t" >/dev/null || die "$t is missing: apt-get install $t (tests/oci/install.sh)"
done
key=$( { sha256sum "$0" | cut -c1-64; echo "$mirror $suite $packages"; } | sha256sum | cut -c1-16)
out=$cache/oci-debian-$key
mkdir -p "$cache"
exec 9>"$cache/.oci-debian.lock"
flock 9
if [ -f "$out/layout/index.json" ]; then
  echo "$out/layout"
  exit 0
fi
start=$(date +%s)
tmp=$(mktemp -d "$cache/oci-debian-tmp.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
say "mmdebstrap --variant=minbase $suite + $packages (from $mirror)"
mmdebstrap --variant=minbase --include="$packages" \
  --dpkgopt='path-exclude=/usr/share/man/*' \
  --dpkgopt='path-exclude=/usr/share/doc/*' \
  --dpkgopt='path-exclude=/usr/share/locale/*' \
  --customize-hook='rm -rf "$1"/var/cache/apt/*.bin "$1"/var/lib/apt/lists/*_*' \
  "$suite" "$tmp/rootfs.tar" "deb $mirror $suite main" >"$tmp/mmdebstrap.log" 2>&1 ||
  die "mmdebstrap failed; last lines:$(echo; tail -20 "$tmp/mmdebstrap.log")"
say "making the OCI layout"
umoci init --layout "$tmp/layout"
umoci new --image "$tmp/layout:1"
umoci raw add-layer --image "$tmp/layout:1" "$tmp/rootfs.tar"
umoci config --image "$tmp/layout:1" \
  --config.env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  --config.cmd /bin/sh --config.cmd -c \
  --config.cmd 'echo main ran >/tmp/main.out; exec sleep infinity'
rm -f "$tmp/rootfs.tar"
rm -rf "$out"
mkdir -p "$out"
mv "$tmp/layout" "$out/layout"
say "built in $(($(date +%s) - start)) s: $out/layout ($(du -sh "$out/layout" | cut -f1))"
echo "$out/layout"
