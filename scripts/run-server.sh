#!/usr/bin/env bash
# Starts env-server on the bundled tasks at 127.0.0.1:8080 (override with --bind), evaluating
# on the GPU where torch sees one and on the CPU elsewhere. Extra flags go to env-server.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
venv="$(scripts/python-env.sh)"
cargo build --release --locked -p env-server
exec ./target/release/env-server --python "$venv/bin/python" --data-dir ./data "$@"
