#!/usr/bin/env bash
# Prints the path of a Python virtual environment holding scripts/requirements.txt (or the
# requirements file given as the argument), creating it on first use. The venv lives outside
# the checkout, keyed by the hash of the requirements file, so fresh clones on the same
# machine (CI, other sessions) reuse it instead of downloading torch's ~3 GB again.
#
# It is built from the system Python (/usr/bin/python3) in a world-traversable place, because
# the sandbox runs tool processes under their own uids: an interpreter under /root or a
# private home directory would be unreachable for them.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
req="${1:-$here/requirements.txt}"
base_python="${CUDA_AGENT_BASE_PYTHON:-/usr/bin/python3}"
if ! "$base_python" -c 'import venv, ensurepip' 2>/dev/null || [ ! -e /usr/include/python3.11/Python.h ] && [ "$base_python" = /usr/bin/python3 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "installing the system python3 with venv and headers" >&2
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3 python3-venv python3-dev) >&2
  fi
fi
key="$(cat "$req" <("$base_python" -c 'import sys; print(sys.version)') | sha256sum | cut -c1-16)"
if [ "$(id -u)" = 0 ]; then default_root=/var/cache/cuda-agent/venvs; else default_root="${XDG_CACHE_HOME:-$HOME/.cache}/cuda-agent/venvs"; fi
root="${CUDA_AGENT_VENV_ROOT:-$default_root}"
venv="$root/$key"
if [ ! -e "$venv/.ready" ]; then
  mkdir -p "$root"
  chmod 755 "$root" "$(dirname "$root")" 2>/dev/null || true
  # A lock so two concurrent setups do not build the same venv at once.
  exec 9>"$root/$key.lock"
  flock 9
  if [ ! -e "$venv/.ready" ]; then
    echo "creating python venv $venv from $req (torch is large; the first time takes minutes)" >&2
    rm -rf "$venv"
    "$base_python" -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade pip >&2
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r "$req" >&2
    chmod -R a+rX "$venv"
    touch "$venv/.ready"
  fi
fi
echo "$venv"
