#!/usr/bin/env bash
# Runs every test: Rust unit, integration and end-to-end tests, against the real sandbox and
# real PyTorch (CPU). Installs what it needs (the Python venv with torch) on first use.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
venv="$(scripts/python-env.sh)"
export CUDA_AGENT_PYTHON="$venv/bin/python"
# Servers the tests start build no precompiled headers unless a test asks (`--pch`).
export CUDA_AGENT_PCH=none
echo "python: $CUDA_AGENT_PYTHON ($("$CUDA_AGENT_PYTHON" -c 'import torch; print("torch", torch.__version__)'))"
cargo test --workspace --locked "$@"
# The Python tests start the server binary cargo just built, wherever its target dir is.
export CUDA_AGENT_SERVER_BIN="${CUDA_AGENT_SERVER_BIN:-$(cargo metadata --format-version 1 --no-deps --locked | "$CUDA_AGENT_PYTHON" -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')/debug/env-server}"
# The Python client against the real server binary cargo just built, the judge's rules, and the
# red-team corpus of adversarial and legitimate candidates (CPU ones; torch.compile is left out
# of the corpus's timing there: it is one more contestant and changes no verdict).
"$CUDA_AGENT_PYTHON" -m pytest -q tests/python
REDTEAM_NO_COMPILE=1 "$CUDA_AGENT_PYTHON" -m pytest -q tests/redteam
