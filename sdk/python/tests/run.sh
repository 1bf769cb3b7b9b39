#!/usr/bin/env bash
# Runs the Python SDK's tests against a real sproutd:
#   sdk/python/tests/run.sh URL [pytest args...]
# e.g. sdk/python/tests/run.sh http://127.0.0.1:7070 -x -k lifecycle
# The pinned test dependencies (requirements.txt) live in a venv cached by
# content in ${SPROUT_CACHE:-~/.cache/sprout}/pysdk-<hash> (the hash of
# requirements.txt, ../pyproject.toml and this script); the SDK itself is not
# installed in it (its source changes without changing the hash): pytest runs
# with PYTHONPATH=sdk/python/src. Needs python3 (3.9 or later) with venv and
# pip. Exits with pytest's status.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
sdk=$(dirname "$here")
[ $# -ge 1 ] || { echo "usage: $0 URL [pytest args...]" >&2; exit 2; }
url=$1
shift
cache=${SPROUT_CACHE:-$HOME/.cache/sprout}
key=$(cat "$here/requirements.txt" "$sdk/pyproject.toml" "$0" | sha256sum | cut -c1-16)
venv="$cache/pysdk-$key"
if [ ! -e "$venv/.complete" ]; then
  command -v python3 >/dev/null || { echo "sdk/python/tests/run.sh: python3 is needed (with venv and pip)" >&2; exit 1; }
  mkdir -p "$cache"
  rm -rf "$venv"
  echo "sdk/python/tests/run.sh: installing the SDK's test dependencies into $venv (about 20 s)" >&2
  # A venv cannot be moved once made: made in place, marked complete last.
  python3 -m venv "$venv" || {
    echo "sdk/python/tests/run.sh: python3 -m venv failed (Debian: apt-get install python3-venv)" >&2
    exit 1
  }
  "$venv/bin/pip" install -q --disable-pip-version-check -r "$here/requirements.txt"
  "$venv/bin/python" -c 'import httpx, pytest, pytest_asyncio'
  touch "$venv/.complete"
fi
cd "$sdk"
export SPROUT_URL="$url"
export PYTHONPATH="$sdk/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1
exec "$venv/bin/python" -m pytest -p no:cacheprovider "$@"
