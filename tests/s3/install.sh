#!/usr/bin/env bash
# Installs the S3-compatible server the snapshot store's tests run on
# loopback: moto's server (PyPI), pinned by requirements.txt, in a venv
# cached by content in ${SPROUT_CACHE:-~/.cache/sprout}/moto-<hash>. Prints
# the path of its moto_server. Needs python3 with venv and pip.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cache=${SPROUT_CACHE:-$HOME/.cache/sprout}
key=$(cat "$here/requirements.txt" "$0" | sha256sum | cut -c1-16)
venv="$cache/moto-$key"
if [ ! -e "$venv/.complete" ]; then
  command -v python3 >/dev/null || { echo "tests/s3/install.sh: python3 is needed (with venv and pip)" >&2; exit 1; }
  mkdir -p "$cache"
  rm -rf "$venv"
  echo "tests/s3/install.sh: installing moto's S3 server into $venv (about 20 s)" >&2
  # A venv cannot be moved once made: made in place, marked complete last.
  python3 -m venv "$venv" || {
    echo "tests/s3/install.sh: python3 -m venv failed (Debian: apt-get install python3-venv)" >&2
    exit 1
  }
  "$venv/bin/pip" install -q --disable-pip-version-check -r "$here/requirements.txt"
  "$venv/bin/moto_server" --help >/dev/null
  touch "$venv/.complete"
fi
echo "$venv/bin/moto_server"
