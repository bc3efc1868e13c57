# Sourced by the benchmarks that run tests/learning.rs (bench_learning.sh, bench_dynamics.sh):
# the release trainer they need, the test venv, and the binaries the test starts.
export CUDA_AGENT_TRAINER_BIN="${CUDA_AGENT_TRAINER_BIN:-$PWD/target/release/trainer}"
[ -x "$CUDA_AGENT_TRAINER_BIN" ] || { echo "no release trainer at $CUDA_AGENT_TRAINER_BIN: cargo build --release -p trainer" >&2; exit 1; }
CUDA_AGENT_PYTHON="${CUDA_AGENT_PYTHON:-$(scripts/python-env.sh)/bin/python}"
export CUDA_AGENT_PYTHON CUDA_AGENT_PCH="${CUDA_AGENT_PCH:-none}"
cargo build --locked --workspace --bins --test learning >&2
export CUDA_AGENT_BIN_DIR="$PWD/target/debug"
