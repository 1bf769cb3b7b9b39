#!/usr/bin/env bash
# Installs what the dashboard's browser test (tests/dashboard/check.py)
# needs: Debian's chromium and chromium-driver when either is missing
# (installing needs root; without it the missing ones are named and it
# fails), and Selenium's Python bindings, pinned by requirements.txt, in a
# venv cached by content in ${SPROUT_CACHE:-~/.cache/sprout}/dashboard-<hash>.
# Prints the path of the venv's python. Needs python3 with venv and pip.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
pkgs=(chromium chromium-driver)
missing=()
for p in "${pkgs[@]}"; do
  [ "$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null)" = "install ok installed" ] || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "tests/dashboard/install.sh: missing Debian packages (${missing[*]}): run as root, or apt-get install them" >&2
    exit 1
  fi
  echo "tests/dashboard/install.sh: installing ${missing[*]}" >&2
  apt-get update -q >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" >&2
fi
for b in /usr/bin/chromium /usr/bin/chromedriver; do
  [ -x "$b" ] || { echo "tests/dashboard/install.sh: $b is missing" >&2; exit 1; }
done
cache=${SPROUT_CACHE:-$HOME/.cache/sprout}
key=$(cat "$here/requirements.txt" "$0" | sha256sum | cut -c1-16)
venv="$cache/dashboard-$key"
if [ ! -e "$venv/.complete" ]; then
  command -v python3 >/dev/null || { echo "tests/dashboard/install.sh: python3 is needed (with venv and pip)" >&2; exit 1; }
  mkdir -p "$cache"
  rm -rf "$venv"
  echo "tests/dashboard/install.sh: installing Selenium into $venv (about 10 s)" >&2
  # A venv cannot be moved once made: made in place, marked complete last.
  python3 -m venv "$venv" || {
    echo "tests/dashboard/install.sh: python3 -m venv failed (Debian: apt-get install python3-venv)" >&2
    exit 1
  }
  "$venv/bin/pip" install -q --disable-pip-version-check -r "$here/requirements.txt" >&2
  "$venv/bin/python" -c 'import selenium.webdriver' >&2
  touch "$venv/.complete"
fi
echo "$venv/bin/python"
