#!/usr/bin/env bash
# Builds Sprout's guest root images as read-only ext4 base images (mkfs.ext4 -d,
# no loop mounts, no Docker), cached outside the clone by content:
#   test     busybox + the agent (seconds)
#   default  Debian minbase (mmdebstrap) + python3 + the agent (about a minute)
#   scratch  the writable-disk template: a 16 GiB sparse ext4 (a few MiB on
#            disk) that the VMM copies for each VM's private writable disk
# Each lands in ${SPROUT_CACHE:-$HOME/.cache/sprout}/image-<name>-<hash>/ and
# is linked as .../images/<name>.ext4; the hash covers this script, the init
# script, the agent binary and the image's inputs (busybox binary, suite and
# package list).
#
# Usage: guest/build-images.sh [--rebuild] [test] [default] [scratch]
#   (no names: all three). Prints "<name> <path>" per image on stdout;
#   progress goes to stderr.
# Environment: SPROUT_DEBIAN_MIRROR (default http://deb.debian.org/debian),
#   SPROUT_DEBIAN_SUITE (default bookworm), SPROUT_AGENT (a prebuilt static
#   sprout-agent to use instead of building one).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
cache=${SPROUT_CACHE:-$HOME/.cache/sprout}
mirror=${SPROUT_DEBIAN_MIRROR:-http://deb.debian.org/debian}
suite=${SPROUT_DEBIAN_SUITE:-bookworm}
# Packages of the default image on top of minbase.
default_packages=python3
scratch_size=16G
init_script=$here/images/sprout-init

# Temporary directories of this run, removed however it ends.
tmps=()
trap 'rm -rf "${tmps[@]}"' EXIT
say() { printf '[build-images %s] %s\n' "$(date +%T)" "$*" >&2; }
die() { say "error: $*"; exit 1; }
sha() { sha256sum "$@" | cut -c1-64; }

rebuild=0
names=()
for a in "$@"; do
  case "$a" in
    --rebuild) rebuild=1 ;;
    test | default | scratch) names+=("$a") ;;
    *) die "unknown image '$a' (test, default, scratch)" ;;
  esac
done
[ ${#names[@]} -gt 0 ] || names=(test default scratch)

command -v mkfs.ext4 >/dev/null || die "mkfs.ext4 is missing: apt-get install e2fsprogs"
mkdir -p "$cache/images"
# One build at a time per cache (a second caller waits, then finds it cached).
exec 9>"$cache/.build-images.lock"
flock 9

# The agent: a static musl binary, stripped.
agent_bin() {
  if [ -n "${SPROUT_AGENT:-}" ]; then
    echo "$SPROUT_AGENT"
    return
  fi
  say "building sprout-agent (static, x86_64-unknown-linux-musl)"
  # (grep without -q throughout: an early exit would fail the pipe under pipefail)
  rustup target list --installed 2>/dev/null | grep -x x86_64-unknown-linux-musl >/dev/null ||
    rustup target add x86_64-unknown-linux-musl >&2 ||
    die "cannot add the Rust target x86_64-unknown-linux-musl"
  (cd "$root" && cargo build --release --locked --target x86_64-unknown-linux-musl \
    -p guest-agent --bin sprout-agent >&2) || die "building sprout-agent failed"
  # (CARGO_TARGET_DIR moves cargo's output: the agent just built is there.)
  local built=${CARGO_TARGET_DIR:-$root/target}/x86_64-unknown-linux-musl/release/sprout-agent
  local stripped=$cache/images/.sprout-agent.stripped
  # Without its GNU build id too: the linker hashes the debug info, whose
  # paths name the checkout, into it (the only bytes two checkouts' builds
  # of one commit differ in). So the agent, and the images keyed by it, are
  # the same from any checkout, and a new clone reuses the cached images.
  strip -R .note.gnu.build-id -o "$stripped.tmp" "$built" || die "cannot strip $built"
  mv "$stripped.tmp" "$stripped"
  echo "$stripped"
}

# mkfs.ext4 -d with room to spare; $3 = extra mkfs options.
make_ext4() {
  local dir=$1 img=$2 label=$3
  local kib files
  kib=$(du -sk --apparent-size "$dir" | cut -f1)
  files=$(find "$dir" | wc -l)
  # 25% + 16 MiB of slack, one inode per file plus headroom.
  local size=$((kib + kib / 4 + 16384))
  rm -f "$img"
  mkfs.ext4 -q -F -L "$label" -O ^has_journal -m 0 -N $((files + files / 4 + 1024)) \
    -E root_owner=0:0 -d "$dir" "$img" "${size}k" >&2 || die "mkfs.ext4 failed for $img"
}

# Publishes $2 (a directory holding $3) as image $1; keeps the two newest
# builds of each image (an older one may still be in use by a VM).
publish() {
  local name=$1 dir=$2 file=$3
  ln -sfn "../$(basename "$dir")/$file" "$cache/images/$name.ext4"
  touch "$dir"
  ls -dt "$cache/image-$name-"* 2>/dev/null | tail -n +3 | xargs -r rm -rf
  say "$name: $dir/$file ($(du -h --apparent-size "$dir/$file" | cut -f1) apparent, $(du -h "$dir/$file" | cut -f1) on disk)"
  echo "$name $cache/images/$name.ext4"
}

common_files() {
  local rootfs=$1 agent=$2
  mkdir -p "$rootfs"/{dev,proc,sys,tmp,run,mnt,root,workspace,sbin,etc}
  chmod 1777 "$rootfs/tmp"
  install -m 0755 "$agent" "$rootfs/sbin/sprout-agent"
  install -m 0755 "$init_script" "$rootfs/sbin/sprout-init"
}

build_test() {
  local agent=$1
  local busybox=/bin/busybox
  [ -x "$busybox" ] && file_is_static "$busybox" || die "a static busybox is needed at $busybox: apt-get install busybox-static"
  local hash
  hash=$( { sha "$0" "$init_script" "$agent" "$busybox"; } | sha | cut -c1-16)
  local out=$cache/image-test-$hash
  if [ "$rebuild" = 0 ] && [ -f "$out/rootfs.ext4" ]; then
    publish test "$out" rootfs.ext4
    return
  fi
  local start tmp
  start=$(date +%s)
  say "test: busybox + agent"
  tmp=$(mktemp -d "$cache/image-tmp.XXXXXX")
  chmod 0755 "$tmp"
  tmps+=("$tmp")
  local rootfs=$tmp/rootfs
  mkdir -p "$rootfs"/{bin,sbin,usr/bin,usr/sbin}
  install -m 0755 "$busybox" "$rootfs/bin/busybox"
  # One link per applet, where busybox itself would install it.
  "$busybox" --list-full | while read -r applet; do
    [ -e "$rootfs/$applet" ] || ln -s /bin/busybox "$rootfs/$applet"
  done
  common_files "$rootfs" "$agent"
  printf 'root:x:0:0:root:/root:/bin/sh\n' >"$rootfs/etc/passwd"
  printf 'root:x:0:\n' >"$rootfs/etc/group"
  printf '127.0.0.1 localhost\n' >"$rootfs/etc/hosts"
  make_ext4 "$rootfs" "$tmp/rootfs.ext4" sprout-test
  rm -rf "$rootfs"
  rm -rf "$out"
  mv "$tmp" "$out"
  say "test: built in $(($(date +%s) - start)) s"
  publish test "$out" rootfs.ext4
}

build_default() {
  local agent=$1
  command -v mmdebstrap >/dev/null || die "mmdebstrap is missing: apt-get install mmdebstrap"
  local hash
  hash=$( { sha "$0" "$init_script" "$agent"; echo "$mirror $suite $default_packages"; } | sha | cut -c1-16)
  local out=$cache/image-default-$hash
  if [ "$rebuild" = 0 ] && [ -f "$out/rootfs.ext4" ]; then
    publish default "$out" rootfs.ext4
    return
  fi
  local start tmp
  start=$(date +%s)
  say "default: mmdebstrap --variant=minbase $suite + $default_packages (from $mirror)"
  tmp=$(mktemp -d "$cache/image-tmp.XXXXXX")
  chmod 0755 "$tmp"
  tmps+=("$tmp")
  local rootfs=$tmp/rootfs
  # No docs, man pages or translations: they only cost image size.
  mmdebstrap --variant=minbase --include="$default_packages" \
    --dpkgopt='path-exclude=/usr/share/man/*' \
    --dpkgopt='path-exclude=/usr/share/doc/*' \
    --dpkgopt='path-include=/usr/share/doc/*/copyright' \
    --dpkgopt='path-exclude=/usr/share/info/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' \
    --dpkgopt='path-include=/usr/share/locale/locale.alias' \
    "$suite" "$rootfs" "deb $mirror $suite main" >"$tmp/mmdebstrap.log" 2>&1 ||
    die "mmdebstrap failed; last lines:$(echo; tail -20 "$tmp/mmdebstrap.log")"
  common_files "$rootfs" "$agent"
  rm -rf "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/lib/apt/lists/*_* "$rootfs"/var/log/*.log
  printf 'sprout\n' >"$rootfs/etc/hostname"
  make_ext4 "$rootfs" "$tmp/rootfs.ext4" sprout-default
  rm -rf "$rootfs"
  rm -rf "$out"
  mv "$tmp" "$out"
  say "default: built in $(($(date +%s) - start)) s"
  publish default "$out" rootfs.ext4
}

build_scratch() {
  local hash
  hash=$( { sha "$0"; mke2fs -V 2>&1 | sed -n 1p; } | sha | cut -c1-16)
  local out=$cache/image-scratch-$hash
  if [ "$rebuild" = 0 ] && [ -f "$out/scratch.ext4" ]; then
    publish scratch "$out" scratch.ext4
    return
  fi
  say "scratch: $scratch_size sparse ext4 template"
  local tmp
  tmp=$(mktemp -d "$cache/image-tmp.XXXXXX")
  chmod 0755 "$tmp"
  tmps+=("$tmp")
  mkdir -p "$tmp/top"/{root,work,workspace}
  truncate -s "$scratch_size" "$tmp/scratch.ext4"
  # Inode tables zeroed now (by punching holes: the file stays sparse), so the
  # guest never starts ext4lazyinit, which would fill the sparse disk with zeros.
  mkfs.ext4 -q -F -L sprout-rw -m 0 -J size=64 -E lazy_itable_init=0,lazy_journal_init=1,root_owner=0:0 \
    -d "$tmp/top" "$tmp/scratch.ext4" || die "mkfs.ext4 failed for the scratch template"
  rm -rf "$tmp/top"
  rm -rf "$out"
  mv "$tmp" "$out"
  publish scratch "$out" scratch.ext4
}

file_is_static() {
  ! LC_ALL=C readelf -l "$1" 2>/dev/null | grep 'Requesting program interpreter' >/dev/null
}

agent=
for n in "${names[@]}"; do
  case "$n" in
    test)
      agent=${agent:-$(agent_bin)}
      build_test "$agent"
      ;;
    default)
      agent=${agent:-$(agent_bin)}
      build_default "$agent"
      ;;
    scratch) build_scratch ;;
  esac
done
