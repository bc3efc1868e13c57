#!/usr/bin/env bash
# Runs every test: Rust unit, integration and end-to-end tests, against the real sandbox and
# real PyTorch (CPU). Installs what it needs (the Python venv with torch) on first use.
#
#   scripts/test.sh                 every test (what CI runs)
#   scripts/test.sh --quick         every crate's unit tests, one evaluation end to end and one
#                                   red-team case of each class (a few minutes)
#   scripts/test.sh -p env-server   other arguments go to `cargo test`
#
# Each phase prints its time on stderr.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
quick=0
if [ "${1:-}" = --quick ]; then
  quick=1
  shift
fi
# shellcheck source=scripts/cpu-busy.sh
. scripts/cpu-busy.sh
phase() {
  local name="$1" start=$SECONDS status=0 ticks
  ticks="$(cpu_ticks)"
  shift
  "$@" || status=$?
  echo "test.sh: $name: $((SECONDS - start)) s, $(busy_since "$ticks") (exit status $status)" >&2
  return "$status"
}
# The Python side's lint gate (ruff.toml), as clippy is the Rust side's: seconds, so first,
# before the torch venv is made.
lint_venv="$(scripts/python-env.sh scripts/requirements-lint.txt)"
phase "ruff" "$lint_venv/bin/ruff" check --quiet
venv="$(scripts/python-env.sh)"
export CUDA_AGENT_PYTHON="$venv/bin/python"
# Servers the tests start build no precompiled headers unless a test asks (`--pch`).
export CUDA_AGENT_PCH=none
echo "python: $CUDA_AGENT_PYTHON ($("$CUDA_AGENT_PYTHON" -c 'import torch; print("torch", torch.__version__)'))"
target="$(cargo metadata --format-version 1 --no-deps --locked | "$CUDA_AGENT_PYTHON" -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')"
# The Python tests start the server binary cargo builds for the tests, wherever its target dir is.
export CUDA_AGENT_SERVER_BIN="${CUDA_AGENT_SERVER_BIN:-$target/debug/env-server}"
# The red-team corpus leaves torch.compile out of its timing on CPU: it is one more contestant
# and changes no verdict.
export REDTEAM_NO_COMPILE=1
# The judge times each evaluation's contestants for half a second, not the servers' default 2:
# the tests assert verdicts, not speedups, and the judge still times its minimum of rounds.
# Every server the tests start (`--timing-budget-s` reads it) and the red-team runner take it.
export CUDA_AGENT_TIMING_BUDGET_S="${CUDA_AGENT_TIMING_BUDGET_S:-0.5}"

if [ "$quick" = 1 ]; then
  # --workspace throughout: the features cargo resolves, and so the build, are the full run's.
  phase "unit tests" cargo test --workspace --locked --lib --bins "$@"
  # The binaries the end-to-end test starts, built with the test build's features.
  phase "binaries" cargo build --workspace --locked --bins --test episode
  # One after the other: the server builds candidates at background priority, so beside the
  # red-team sample the evaluation's build would mostly wait.
  CUDA_AGENT_BIN_DIR="$target/debug" \
    phase "one evaluation end to end" cargo test --workspace --locked --test episode -- --exact an_episode_with_every_tool_then_submit
  # The extensions the cases build are kept in the target dir between quick runs.
  REDTEAM_EXT_DIR="$target/redteam-torch-extensions" \
    phase "red-team, one case per class" "$CUDA_AGENT_PYTHON" -m pytest -q tests/redteam/test_redteam.py --one-per-class
  exit 0
fi

# The tests and every workspace binary in one build: `--tests` resolves features as `cargo
# test --workspace` does, so the binaries the end-to-end tests start (CUDA_AGENT_BIN_DIR) are
# the ones the test build links against, and nothing is built again inside the tests.
phase "test build" cargo build --workspace --locked --bins --tests
export CUDA_AGENT_BIN_DIR="$target/debug"
# The learning test runs the trainer as an optimised binary (its ML code is 40-55x slower in
# debug), built here once, not by the test, in Cargo.toml's `learning` profile (release at
# opt-level 1: a quarter less to build, the test about as fast); by rustc alone: .ci/run's
# clippy driver (RUSTC_WORKSPACE_WRAPPER) lints the debug build, and would build this one
# without MIR optimisations. It is built before the Python tests and the red-team corpus, not beside them:
# at the candidates' build priority it starved their builds past the 300 s build limit. The
# Python client's tests run against the real server binary cargo built and the judge's rules,
# a test file per core at a time (a file's module fixtures, its server or its extension build,
# stay in one process); the red-team corpus of adversarial and legitimate candidates (CPU ones)
# runs several cases at a time. Their verdicts depend on timing (late work, timed outputs), so
# no other test runs beside them: cargo's tests come after.
status=0
# Precompiled torch headers for the flags the tests' candidates build with, made once (about
# a core-minute each) beside the release build and shared by every server the tests start
# (CUDA_AGENT_PCH_DIR, CUDA_AGENT_PCH) and every build the Python tests run outside a server
# (CPATH): a C++ candidate's build then takes about 15 core-seconds instead of 35. A build
# whose flags match no variant parses the headers as before.
export CUDA_AGENT_PCH_DIR="$target/pch" CUDA_AGENT_PCH="-O3;-O3 -fopenmp"
mkdir -p "$target/test-logs"
pch_start=$SECONDS
"$CUDA_AGENT_BIN_DIR/env-server" --pch-only --device cpu --python "$CUDA_AGENT_PYTHON" \
  > "$target/pch.include" 2> "$target/test-logs/pch.log" &
pch_pid=$!
phase "trainer build (learning profile)" env -u RUSTC_WORKSPACE_WRAPPER -u CLIPPY_ARGS \
  cargo build --profile learning --locked -p trainer --bin trainer || status=$?
export CUDA_AGENT_TRAINER_BIN="$target/learning/trainer"
pch_include=""
if wait "$pch_pid"; then
  pch_include="$(tail -n 1 "$target/pch.include")"
else
  # Not fatal: every build then parses the headers, as without them.
  echo "test.sh: precompiled headers not made ($target/test-logs/pch.log):" >&2
  tail -3 "$target/test-logs/pch.log" >&2
  unset CUDA_AGENT_PCH_DIR
  export CUDA_AGENT_PCH=none
fi
echo "test.sh: precompiled headers: $((SECONDS - pch_start)) s (${pch_include:-none})" >&2
python_status=0
# (An empty CPATH would put the working directory on every build's include path.)
[ -n "$pch_include" ] && export CPATH="$pch_include"
phase "python tests" "$CUDA_AGENT_PYTHON" -m pytest -q -n auto --dist loadfile tests/python || python_status=$?
phase "red-team corpus" "$CUDA_AGENT_PYTHON" -m pytest -q tests/redteam || python_status=$?
unset CPATH
# cargo's test binaries three at a time, not one after another (most wait on servers and
# judges): the ones that judge real candidates one at a time at normal priority, most others
# beside them at the candidates' build priority, two load-sensitive ones alone. Each
# binary's output is printed whole when it ends; scripts/cargo_test_parallel.py says which
# binary is which and why.
phase "cargo test" "$CUDA_AGENT_PYTHON" scripts/cargo_test_parallel.py --workspace --locked "$@" || status=$?
[ "$status" = 0 ] && [ "$python_status" = 0 ]
