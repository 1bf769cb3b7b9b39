#!/usr/bin/env bash
# Installs the Debian packages Sprout's Linux guests, the emulated lab and the
# build need, when any is missing (./test and ./serve run it). Installing
# needs root; without it the missing ones are named and it fails. Under CI
# (CI set) the package lists are refreshed even when nothing is missing: the
# lab takes the current Debian cloud kernel package.
set -euo pipefail
pkgs=(linux-source-6.12 build-essential bc bison flex libelf-dev libssl-dev cpio xz-utils
  zstd e2fsprogs busybox-static mmdebstrap qemu-system-x86 binutils ca-certificates iproute2 nftables
  libclang-dev) # libclang: userfaultfd-sys (snapshot's uffd backend) runs bindgen
missing=()
for p in "${pkgs[@]}"; do
  [ "$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null)" = "install ok installed" ] || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ] || [ -n "${CI:-}" ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "error: missing Debian packages (${missing[*]}): run as root, or apt-get install them" >&2
    exit 1
  fi
  apt-get update -q
  if [ ${#missing[@]} -gt 0 ]; then
    echo "installing: ${missing[*]}"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
  fi
fi
