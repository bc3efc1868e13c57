#!/usr/bin/env bash
# Runs every test: Rust unit, integration and end-to-end tests, against the real sandbox and
# real PyTorch (CPU). Installs what it needs (the Python venv with torch) on first use.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
venv="$(scripts/python-env.sh)"
export CUDA_AGENT_PYTHON="$venv/bin/python"
echo "python: $CUDA_AGENT_PYTHON ($("$CUDA_AGENT_PYTHON" -c 'import torch; print("torch", torch.__version__)'))"
cargo test --workspace --locked "$@"
# The Python client against the real server binary cargo just built.
"$CUDA_AGENT_PYTHON" -m pytest -q tests/python
