#!/usr/bin/env bash
# Prints the path of a Python virtual environment holding scripts/requirements.txt,
# creating it on first use. The venv lives outside the checkout, keyed by the hash of the
# requirements file, so fresh clones on the same machine (CI, other sessions) reuse it
# instead of downloading torch's ~3 GB again.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
req="$here/requirements.txt"
key="$(sha256sum "$req" | cut -c1-16)"
root="${CUDA_AGENT_VENV_ROOT:-${XDG_CACHE_HOME:-$HOME/.cache}/cuda-agent/venvs}"
venv="$root/$key"
if [ ! -x "$venv/.ready" ]; then
  mkdir -p "$root"
  # A lock so two concurrent setups do not build the same venv at once.
  exec 9>"$root/$key.lock"
  flock 9
  if [ ! -x "$venv/.ready" ]; then
    echo "creating python venv $venv (torch is large; first time takes minutes)" >&2
    rm -rf "$venv"
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --upgrade pip >&2
    "$venv/bin/python" -m pip install --quiet -r "$req" >&2
    printf '#!/bin/sh\n' >"$venv/.ready" && chmod +x "$venv/.ready"
  fi
fi
echo "$venv"
