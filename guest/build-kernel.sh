#!/usr/bin/env bash
# Builds Sprout's guest kernel: Debian's linux-source-6.12 with our config
# fragment (guest/kernel/sprout.config) merged onto `tinyconfig`, as an
# uncompressed ELF vmlinux. The result is cached outside the clone in
#   ${SPROUT_CACHE:-$HOME/.cache/sprout}/kernel-<hash>/vmlinux
# where <hash> covers the source package version, the compiler, the fragment
# and this script; an unchanged rebuild only prints the path. The newest build
# is also linked as ${SPROUT_CACHE:-$HOME/.cache/sprout}/vmlinux (where sprout
# looks by default). The unpacked source (src/) and the build tree
# (kbuild-<hash of version, compiler and fragment>/) stay in the cache, so a
# rebuild after an edit of this script alone only relinks.
#
# Usage: guest/build-kernel.sh [--path]
#   --path   print where the kernel is (or would be) cached and exit.
# Progress goes to stderr; the path of vmlinux is the only line on stdout.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
cache=${SPROUT_CACHE:-$HOME/.cache/sprout}
pkg=linux-source-6.12
tarball=/usr/src/$pkg.tar.xz
fragment=$here/kernel/sprout.config

say() { printf '[build-kernel %s] %s\n' "$(date +%T)" "$*" >&2; }
die() { say "error: $*"; exit 1; }

ver=$(dpkg-query -W -f='${Version}' "$pkg" 2>/dev/null) || ver=
if [ -z "$ver" ] || [ ! -f "$tarball" ]; then
  die "$pkg is not installed: apt-get install $pkg (plus: build-essential bc bison flex libelf-dev libssl-dev)"
fi
cc_ver=$(gcc --version 2>/dev/null | sed -n 1p) || die "gcc is missing: apt-get install build-essential"
hash=$({
  echo "$pkg $ver"
  echo "$cc_ver"
  cat "$fragment" "$here/build-kernel.sh"
} | sha256sum | cut -c1-16)
out=$cache/kernel-$hash
# The build tree is kept, keyed by what changes the objects (not this script),
# so a rebuild after an edit of this script only relinks.
build_hash=$({
  echo "$pkg $ver"
  echo "$cc_ver"
  cat "$fragment"
} | sha256sum | cut -c1-16)

if [ "${1:-}" = "--path" ]; then
  echo "$out/vmlinux"
  exit 0
fi
mkdir -p "$cache"
# One build at a time per cache (a second caller waits, then finds it cached).
exec 9>"$cache/.build-kernel.lock"
flock 9
if [ -f "$out/vmlinux" ]; then
  touch "$out"
  ln -sfn "kernel-$hash/vmlinux" "$cache/vmlinux"
  say "cached: $out/vmlinux ($pkg $ver)"
  echo "$out/vmlinux"
  exit 0
fi

for tool in make bc bison flex; do
  command -v "$tool" >/dev/null || die "$tool is missing: apt-get install build-essential bc bison flex libelf-dev libssl-dev"
done

start=$(date +%s)
src=$cache/src/$pkg-$ver
if [ ! -f "$src/Makefile" ]; then
  say "unpacking $tarball ($ver)"
  tmp=$(mktemp -d "$cache/src-unpack.XXXXXX")
  tar -xf "$tarball" -C "$tmp"
  mkdir -p "$cache/src"
  rm -rf "$src"
  mv "$tmp/$pkg" "$src"
  rmdir "$tmp"
fi

build=$cache/kbuild-$build_hash
mkdir -p "$build"
log=$build/build.log
: >"$log"
export KBUILD_BUILD_USER=sprout KBUILD_BUILD_HOST=sprout KBUILD_BUILD_TIMESTAMP="$pkg $ver"
mk() { make -C "$src" O="$build" ARCH=x86_64 "$@"; }

say "configuring: tinyconfig + $(basename "$fragment")"
mk tinyconfig >>"$log" 2>&1 || die "tinyconfig failed; see $log"
(cd "$build" && "$src/scripts/kconfig/merge_config.sh" -m .config "$fragment") >>"$log" 2>&1 ||
  die "merge_config.sh failed; see $log"
mk olddefconfig >>"$log" 2>&1 || die "olddefconfig failed; see $log"

# Every option of the fragment must survive Kconfig's dependency resolution.
missing=0
while IFS= read -r line; do
  case "$line" in
    CONFIG_*=*)
      grep -qxF "$line" "$build/.config" || {
        say "dropped by Kconfig: $line (now: $(grep -E "^(# )?${line%%=*}[= ]" "$build/.config" || echo unset))"
        missing=1
      }
      ;;
    "# CONFIG_"*" is not set")
      opt=${line#\# }
      opt=${opt%% *}
      if grep -q "^$opt=" "$build/.config"; then
        say "wanted off but on: $(grep "^$opt=" "$build/.config")"
        missing=1
      fi
      ;;
  esac
done <"$fragment"
[ "$missing" = 0 ] || die "the config fragment did not apply (see above); fix guest/kernel/sprout.config"
say "config verified: every option of the fragment is in .config"

jobs=$(nproc)
say "compiling vmlinux with $jobs jobs (log: $log)"
mk -j"$jobs" vmlinux 2>&1 | tee -a "$log" |
  awk '/^  (CC|AS|AR|LD)/ { n++; if (n % 250 == 0) { printf "[build-kernel] ... %d objects\n", n > "/dev/stderr" } }' ||
  die "kernel build failed; last lines of $log:$(echo; tail -30 "$log")"
[ "$(head -c 4 "$build/vmlinux" | od -An -c | tr -d ' ')" = '177ELF' ] || die "$build/vmlinux is not an ELF file"

tmp_out=$(mktemp -d "$cache/kernel-tmp.XXXXXX")
chmod 0755 "$tmp_out"
cp "$build/vmlinux" "$tmp_out/vmlinux"
cp "$build/.config" "$tmp_out/config"
echo "$pkg $ver" >"$tmp_out/source"
rm -rf "$out"
mv "$tmp_out" "$out"
ln -sfn "kernel-$hash/vmlinux" "$cache/vmlinux"
# Keep the two newest kernels and the newest build tree.
ls -dt "$cache"/kernel-[0-9a-f]*[0-9a-f] | tail -n +3 | xargs -r rm -rf
ls -dt "$cache"/kbuild-* | tail -n +2 | xargs -r rm -rf
say "built $out/vmlinux ($(du -h "$out/vmlinux" | cut -f1)) in $(($(date +%s) - start)) s"
echo "$out/vmlinux"
