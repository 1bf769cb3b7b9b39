#!/usr/bin/env bash
# Builds the emulated hardware-virtualization lab (see docs/guest.md): an outer
# initramfs that boots Debian's cloud kernel under QEMU TCG (an emulated AMD CPU
# with SVM), loads kvm_amd nested=1 and runs a test script against the /dev/kvm
# it gets. Cached by content in ${SPROUT_CACHE:-$HOME/.cache/sprout}/lab-<hash>/
# (linked as .../lab):
#   vmlinuz       Debian's linux-image-cloud-amd64 kernel
#   initrd.cpio   busybox, /init, kvm/kvm-amd/irqbypass, virtio, and the
#                 network modules (tun, veth, nftables NAT and conntrack),
#                 sprout (release build and its shared libraries), mkfs.ext4
#                 (and its libraries and mke2fs.conf: a lab sproutd converts
#                 OCI images), iproute2's ip and nft (and their libraries: a
#                 lab sproutd gives each sandbox a network), the test guest
#                 and the guest kernel
#   images.ext4   the guest images (test, default, scratch) and the static
#                 agent OCI conversions add, attached read-only as the outer
#                 VM's virtio disk and mounted at /opt/sprout/images
#   guest.syms    the guest kernel's text symbols
#   guest.vmlinux the guest kernel's path (for the bytes at a frozen CPU's RIP)
#
# Usage: tests/lab/build.sh [--no-default]
#   --no-default  leave the default (Debian + python3) image out of the lab
# Environment: SPROUT_GUEST_KERNEL, a guest vmlinux to use instead of building
#   ours with guest/build-kernel.sh. SPROUT_LAB_KERNEL, the Debian package
#   (or meta-package) of the outer kernel, linux-image-cloud-amd64 unless set.
# Prints the lab directory on stdout; progress goes to stderr.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
cache=${SPROUT_CACHE:-$HOME/.cache/sprout}

# Temporary directories of this run, removed however it ends.
tmps=()
trap 'rm -rf "${tmps[@]}"' EXIT
say() { printf '[lab-build %s] %s\n' "$(date +%T)" "$*" >&2; }
die() { say "error: $*"; exit 1; }
sha() { sha256sum "$@" | cut -c1-64; }

with_default=1
for a in "$@"; do
  case "$a" in
    --no-default) with_default=0 ;;
    *) die "unknown option $a" ;;
  esac
done

for tool in apt-get apt-cache dpkg-deb cpio mkfs.ext4 qemu-system-x86_64; do
  command -v "$tool" >/dev/null ||
    die "$tool is missing: apt-get install --no-install-recommends qemu-system-x86 cpio e2fsprogs"
done
# A host tool that may live in an sbin directory (not on every user's PATH).
host_tool() { PATH=/usr/sbin:/sbin:$PATH command -v "$1"; }
for tool in ip nft; do
  host_tool "$tool" >/dev/null || die "$tool is missing: apt-get install --no-install-recommends iproute2 nftables"
done
[ -x /bin/busybox ] || die "busybox is missing: apt-get install busybox-static"
mkdir -p "$cache"
# One build at a time per cache (a second caller waits, then finds it cached).
exec 9>"$cache/.lab-build.lock"
flock 9
start=$(date +%s)

# --- 1. The outer kernel: Debian's cloud kernel and its modules -------------
meta=${SPROUT_LAB_KERNEL:-linux-image-cloud-amd64}
pkg=$(apt-cache depends "$meta" 2>/dev/null | awk '/Depends: linux-image-/ && !n++ { print $2 }')
# Modules the lab loads (KVM; virtio-blk over PCI for the images and data
# disks; virtio-net for sproutd's port when it is served from the lab, see
# service/src/daemon/lab.rs; each sandbox's network as sproutd makes it: TAP
# devices, veth pairs into network namespaces (built in), and an nftables
# inet table with masquerade and conntrack state); their load order comes
# from the modules' own depends= lists. One the kernel has built in
# (modules.builtin; Debian's cloud kernel has crc32c_generic, which
# libcrc32c asks the crypto API for) is skipped. The set is part of the
# outer kernel's cache key.
modules="kvm-amd kvm irqbypass virtio_blk virtio virtio_ring virtio_pci virtio_pci_legacy_dev virtio_pci_modern_dev virtio_net net_failover failover"
modules+=" tun veth nfnetlink nf_tables nft_chain_nat nft_masq nft_ct nf_nat nf_conntrack nf_defrag_ipv4 nf_defrag_ipv6 libcrc32c crc32c_generic"
mkey=$(echo "$modules" | sha | cut -c1-8)
if [ -n "$pkg" ]; then
  ver=$(apt-cache show --no-all-versions "$pkg" | awk '/^Version:/ && !n++ { print $2 }')
  outer=$cache/lab-outer-${pkg}_${ver}-$mkey
else
  # No package lists (no apt-get update yet): an outer kernel fetched before
  # with the same modules will do.
  outer=$(ls -dt "$cache"/lab-outer-linux-image-*-"$mkey" 2>/dev/null | sed -n 1p)
  [ -n "$outer" ] && [ -f "$outer/vmlinuz" ] || die "apt-cache knows no $meta: run apt-get update"
  pkg=$(basename "$outer")
  ver=cached
fi
if [ ! -f "$outer/vmlinuz" ]; then
  say "fetching $pkg $ver"
  tmp=$(mktemp -d "$cache/lab-outer-tmp.XXXXXX")
  tmps+=("$tmp")
  chmod 0755 "$tmp"
  (cd "$tmp" && apt-get download -q "$pkg=$ver" >&2) || die "apt-get download $pkg failed"
  dpkg-deb -x "$tmp"/*.deb "$tmp/x"
  release=$(ls "$tmp/x/lib/modules")
  mkdir -p "$tmp/out/modules"
  cp "$tmp/x/boot/vmlinuz-$release" "$tmp/out/vmlinuz"
  # The kernel's built-in modules, by name (- and _ are the same to it).
  [ -f "$tmp/x/lib/modules/$release/modules.builtin" ] || die "$pkg has no modules.builtin"
  builtin=" $(sed 's|.*/||; s|\.ko$||; s|-|_|g' "$tmp/x/lib/modules/$release/modules.builtin" | tr '\n' ' ') "
  is_builtin() { case "$builtin" in *" ${1//-/_} "*) true ;; *) false ;; esac; }
  # The modules to load: those of the set the kernel does not have built in.
  load=
  built=
  for m in $modules; do
    f=$(find "$tmp/x/lib/modules/$release" -name "$m.ko*" -print -quit)
    if [ -z "$f" ]; then
      is_builtin "$m" || die "$pkg has no module $m (neither a .ko nor in modules.builtin)"
      built="$built $m"
      continue
    fi
    load="$load $m"
    case "$f" in
      *.ko) cp "$f" "$tmp/out/modules/$m.ko" ;;
      *.ko.xz) xz -dc "$f" >"$tmp/out/modules/$m.ko" ;;
      *.ko.zst) zstd -qdc "$f" >"$tmp/out/modules/$m.ko" ;;
      *) die "unknown module compression: $f" ;;
    esac
    # The modules must be the kernel's own build.
    magic=$(grep -a -o -m1 'vermagic=[[:print:]]*' "$tmp/out/modules/$m.ko" | cut -d= -f2-)
    case "$magic" in
      "$release "*) ;;
      *) die "$m.ko is for '$magic', not $release" ;;
    esac
  done
  # Dependencies first.
  order=
  left=$load
  while [ -n "$left" ]; do
    next=
    for m in $left; do
      deps=$(grep -a -o -m1 'depends=[[:print:]]*' "$tmp/out/modules/$m.ko" | cut -d= -f2- | tr ',' ' ')
      ready=1
      for d in $deps; do
        # (A built-in one is there from boot.)
        if is_builtin "$d"; then continue; fi
        d=${d//_/-}
        case " ${load//_/-} " in *" $d "*) ;; *) die "$m needs module $d, which the lab does not load" ;; esac
        case " ${order//_/-} " in *" $d "*) ;; *) ready=0 ;; esac
      done
      if [ "$ready" = 1 ]; then order="$order $m"; else next="$next $m"; fi
    done
    [ "$next" != "$left" ] || die "module dependency cycle among:$left"
    left=$next
  done
  echo $order >"$tmp/out/modules/order"
  echo $built >"$tmp/out/modules/builtin"
  echo "$release" >"$tmp/out/release"
  rm -rf "$outer"
  mv "$tmp/out" "$outer"
  rm -rf "$tmp"
fi
say "outer kernel: $pkg $ver ($(cat "$outer/release"))"
say "modules: $(cat "$outer/modules/order"); built in: $(cat "$outer/modules/builtin" 2>/dev/null)"

# --- 2. What runs inside: guest kernel, images, sprout, the test guest ------
vmlinux=${SPROUT_GUEST_KERNEL:-$("$root/guest/build-kernel.sh")}
images=(test scratch)
[ "$with_default" = 0 ] || images+=(default)
declare -A image_path
while read -r name path; do
  image_path[$name]=$(readlink -f "$path")
done < <("$root/guest/build-images.sh" "${images[@]}")

# The host build of sprout (glibc), with the shared libraries it needs: the
# workspace is not kept buildable for musl (see docs/guest.md).
say "building sprout (release)"
json=$(cd "$root" && cargo build --release --locked -p service --bin sprout \
  --message-format=json-render-diagnostics) || die "building sprout failed"
# Where cargo put it (CARGO_TARGET_DIR may move the target directory).
sprout=$(printf '%s\n' "$json" | grep '"reason":"compiler-artifact"' | grep '"executable":"[^"]*/sprout"' |
  tail -1 | sed 's/.*"executable":"\([^"]*\)".*/\1/')
[ -n "$sprout" ] || sprout=$root/target/release/sprout
# sprout-worker goes beside it, as in an install: sproutd and `sprout vm fork`
# start every worker from it. Built static and not position-independent: in
# the lab a worker then starts in ~16 ms, against ~42 ms for the dynamic
# 2 MiB build and ~75 ms for `sprout worker` (26 MiB, 48k relocations), see
# docs/benchmarks.md. An explicit --target keeps these flags off build
# scripts and proc macros.
say "building sprout-worker (release, static)"
wjson=$(cd "$root" && RUSTFLAGS="${RUSTFLAGS:-} -C target-feature=+crt-static -C relocation-model=static" \
  cargo build --release --locked -p sprout-worker --bin sprout-worker --target x86_64-unknown-linux-gnu \
  --message-format=json-render-diagnostics) || die "building sprout-worker failed"
worker=$(printf '%s\n' "$wjson" | grep '"reason":"compiler-artifact"' | grep '"executable":"[^"]*/sprout-worker"' |
  tail -1 | sed 's/.*"executable":"\([^"]*\)".*/\1/')
[ -n "$worker" ] || worker=${CARGO_TARGET_DIR:-$root/target}/x86_64-unknown-linux-gnu/release/sprout-worker
[ -x "$worker" ] || die "no sprout-worker binary at $worker"
testguest=$(printf '%s\n' "$json" | grep -o '"TESTGUEST_PATH","[^"]*"' | tail -1 | cut -d'"' -f4)
[ -x "$sprout" ] || die "no sprout binary at $sprout"
[ -f "$testguest" ] || die "cannot find the test guest the sprout build made"
# OCI conversion in the lab: mkfs.ext4, and the static agent build-images.sh made.
mkfs=$(command -v mkfs.ext4)
agent=$cache/images/.sprout-agent.stripped
[ -f "$agent" ] || die "no guest agent at $agent (guest/build-images.sh builds it)"
# Sandbox networks in a lab sproutd: iproute2's ip (network namespaces, veth,
# TAP, -batch, -n: busybox's applet has none of them) and nft. Both go in as
# /usr/sbin/{ip,nft}, ahead of busybox's applets on the lab's PATH (and
# linked from /sbin and /bin, where busybox --install would otherwise put
# its ip).
ipbin=$(readlink -f "$(host_tool ip)")
nftbin=$(readlink -f "$(host_tool nft)")
"$ipbin" -V 2>/dev/null | grep -q iproute2 || die "$ipbin is not iproute2's ip: apt-get install iproute2"
# Every shared object sprout, mkfs.ext4, ip and nft load, the dynamic loader
# included (absolute paths).
libs=$({ ldd "$sprout"; ldd "$mkfs"; ldd "$ipbin"; ldd "$nftbin"; } | grep -o '/[^ ]*' | sort -u)
# The CA certificates, as on any host: the lab's sproutd sets up TLS for
# every registry pull (even a plain-HTTP loopback one) and cannot without.
cacerts=/etc/ssl/certs/ca-certificates.crt
[ -f "$cacerts" ] || die "no CA certificates at $cacerts: apt-get install ca-certificates"

# --- 3. The lab itself, keyed by everything above -----------------------------
key=$( {
  echo "$pkg $ver"
  # shellcheck disable=SC2086
  sha "$0" "$here/init" /bin/busybox "$sprout" "$worker" "$testguest" "$vmlinux" "$mkfs" /etc/mke2fs.conf "$agent" "$cacerts" \
    "$ipbin" "$nftbin" $libs
  for n in "${images[@]}"; do echo "$n ${image_path[$n]}"; done
} | sha | cut -c1-16)
lab=$cache/lab-$key
if [ -f "$lab/initrd.cpio" ] && [ -f "$lab/images.ext4" ]; then
  touch "$lab"
  ln -sfn "lab-$key" "$cache/lab"
  say "cached: $lab"
  echo "$lab"
  exit 0
fi

tmp=$(mktemp -d "$cache/lab-tmp.XXXXXX")
tmps+=("$tmp")
chmod 0755 "$tmp"
say "assembling the initramfs"
ird=$tmp/initrd
mkdir -p "$ird"/{bin,sbin,dev,proc,sys,tmp,run,var,etc,usr/sbin,lib/modules,opt/sprout/bin,opt/sprout/images,lab}
cp /bin/busybox "$ird/bin/busybox"
install -m 0755 "$here/init" "$ird/init"
cp "$outer"/modules/*.ko "$ird/lib/modules/"
cp "$outer/modules/order" "$ird/lib/modules/order"
strip -o "$ird/opt/sprout/bin/sprout" "$sprout"
strip -o "$ird/opt/sprout/bin/sprout-worker" "$worker"
cp -L "$mkfs" "$ird/usr/sbin/mkfs.ext4"
cp -L "$ipbin" "$ird/usr/sbin/ip"
cp -L "$nftbin" "$ird/usr/sbin/nft"
ln -s ../usr/sbin/ip "$ird/sbin/ip"
ln -s ../usr/sbin/ip "$ird/bin/ip"
ln -s ../usr/sbin/nft "$ird/sbin/nft"
# ip netns add makes /run/netns (one level: /run must be there); some tools
# still name /var/run.
ln -s ../run "$ird/var/run"
cp /etc/mke2fs.conf "$ird/etc/mke2fs.conf"
mkdir -p "$ird/etc/ssl/certs"
cp -L "$cacerts" "$ird/etc/ssl/certs/ca-certificates.crt"
for lib in $libs; do
  mkdir -p "$ird$(dirname "$lib")"
  cp -L "$lib" "$ird$lib"
done
cp "$testguest" "$ird/opt/sprout/testguest"
cp "$vmlinux" "$ird/opt/sprout/vmlinux"
(cd "$ird" && find . | LC_ALL=C sort | cpio -o -H newc -R 0:0 --quiet) >"$tmp/initrd.cpio"

say "assembling the images disk (${images[*]})"
mkdir -p "$tmp/images"
for n in "${images[@]}"; do
  ln "${image_path[$n]}" "$tmp/images/$n.ext4" 2>/dev/null || cp --sparse=always "${image_path[$n]}" "$tmp/images/$n.ext4"
done
cp "$agent" "$tmp/images/.sprout-agent.stripped"
kib=$(du -sk --apparent-size "$tmp/images" | cut -f1)
mkfs.ext4 -q -F -L sprout-images -O ^has_journal -m 0 -E root_owner=0:0 -d "$tmp/images" \
  "$tmp/images.ext4" "$((kib + kib / 50 + 65536))k" >&2 || die "mkfs.ext4 failed for the images disk"
rm -rf "$tmp/images" "$ird"
cp "$outer/vmlinuz" "$tmp/vmlinuz"
# The guest kernel's text symbols (it has no KASLR): tests/lab/run.sh names
# where a frozen machine's CPUs were. (Debian's System.map is a stub; the
# lab's own kernel is told apart by its code not being the guest kernel's.)
nm -n "$vmlinux" | grep -i ' [tw] ' >"$tmp/guest.syms" || true
readlink -f "$vmlinux" >"$tmp/guest.vmlinux"
rm -rf "$lab"
mv "$tmp" "$lab"
ln -sfn "lab-$key" "$cache/lab"
# Keep the two newest labs, and any in use: tests/lab/run.sh and a
# lab-hosted sproutd hold a shared lock on <lab>/.in-use while they run (an
# older lab may serve a test run of another checkout).
ls -dt "$cache"/lab-[0-9a-f]*[0-9a-f] 2>/dev/null | tail -n +3 |
  while read -r old; do
    if flock -n -x "$old/.in-use" true 2>/dev/null; then rm -rf "$old"; fi
  done
say "built $lab in $(($(date +%s) - start)) s (initrd $(du -h "$lab/initrd.cpio" | cut -f1), images disk $(du -h "$lab/images.ext4" | cut -f1) on disk)"
echo "$lab"
