#!/usr/bin/env bash
# Installs what the OCI image tests (service/tests/oci.rs, lab_oci.rs) need,
# all Debian packages: umoci (builds image layouts), skopeo (pushes them) and
# docker-registry (the registry they run on loopback); debugfs comes with
# e2fsprogs. Installing needs root; without it the missing ones are named
# and it fails.
set -euo pipefail
pkgs=(umoci skopeo docker-registry e2fsprogs)
missing=()
for p in "${pkgs[@]}"; do
  [ "$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null)" = "install ok installed" ] || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "tests/oci/install.sh: missing Debian packages (${missing[*]}): run as root, or apt-get install them" >&2
    exit 1
  fi
  echo "tests/oci/install.sh: installing ${missing[*]}" >&2
  apt-get update -q >&2
  # (docker-registry's own service is not wanted: the tests start theirs.)
  DEBIAN_FRONTEND=noninteractive RUNLEVEL=1 apt-get install -y -q --no-install-recommends "${missing[@]}" >&2
fi
for b in umoci skopeo docker-registry debugfs; do
  command -v "$b" >/dev/null || { echo "tests/oci/install.sh: $b is missing after the install" >&2; exit 1; }
done
