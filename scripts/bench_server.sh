#!/usr/bin/env bash
# Load test: a release env-server (CPU device) and the env-bench client as a second process.
# Prints p50/p99 latency of reset, a Glob step and a Bash `true` step, throughput at 1, 16, 64,
# 256 and 1000 concurrent episodes, and the server's memory per idle episode.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
venv="$(scripts/python-env.sh)"
cargo build --release --locked -p env-server -p env-client
data="$(mktemp -d /tmp/cuda-agent-bench.XXXXXX)"
chmod 711 "$data"
port="${PORT:-18181}"
./target/release/env-server --bind "127.0.0.1:$port" --data-dir "$data/data" --python "$venv/bin/python" \
  --device cpu --skip-compile --max-episodes 5000 2>"$data/server.log" &
pid=$!
trap 'kill $pid 2>/dev/null; wait $pid 2>/dev/null; rm -rf "$data"' EXIT
for _ in $(seq 100); do curl -sf "http://127.0.0.1:$port/v1/health" >/dev/null && break; sleep 0.1; done
./target/release/env-bench --url "http://127.0.0.1:$port" --server-pid "$pid" "$@"
