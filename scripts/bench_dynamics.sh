#!/usr/bin/env bash
# The training-dynamics benchmark: long PPO runs on the `tiny` split (CPU) of the recipe (RFT,
# value pre-training, PPO) and of its two ablations (no RFT; no value pre-training), per seed
# (tests/learning.rs `training_dynamics` says what each run does). Prints each run's mean
# reward before and after PPO and draws every run's PPO curves (reward, entropy, KL, clip
# fraction, explained variance, ...) on one figure.
#
#   scripts/bench_dynamics.sh [OUT_DIR]     (STEPS=150 SEEDS="0 1 2" VARIANTS="recipe no_rft no_value" FAMILY=tiny)
#
# FAMILY picks the tasks: `tiny` (the word in the prompt; RFT alone solves it) or `clue` (the
# word in the workspace's clue.txt, demonstrations of half the tasks: RFT leaves PPO work to
# do, so the variants can differ in how fast PPO learns; docs/BENCHMARKS.md).
#
# Needs the release trainer (cargo build --release -p trainer, or CUDA_AGENT_TRAINER_BIN) and
# the test venv (scripts/python-env.sh). A PPO step of the tiny policy takes a few seconds on
# two cores, so the defaults run for hours: set STEPS and SEEDS for a shorter look.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="${1:-target/bench-dynamics}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
# shellcheck source=scripts/learning-env.sh
. scripts/learning-env.sh
DYNAMICS_OUT="$out" DYNAMICS_FAMILY="${FAMILY:-tiny}" DYNAMICS_STEPS="${STEPS:-150}" DYNAMICS_SEEDS="${SEEDS:-0 1 2}" \
  DYNAMICS_VARIANTS="${VARIANTS:-recipe no_rft no_value}" \
  cargo test --locked -p e2e-tests --test learning -- --ignored --exact training_dynamics --nocapture \
  > "$out/run.log" 2>&1 || { echo "the runs failed (see $out/run.log)" >&2; tail -20 "$out/run.log" >&2; }
echo "| run | mean reward before | after PPO |"
echo "|---|---:|---:|"
"$CUDA_AGENT_PYTHON" - "$out/summary.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    print(f"| {r['run']} | {r['before']:.3f} | {r['after_ppo']:.3f} |")
PY
runs=() labels=()
for f in "$out"/*-seed*.jsonl; do
  runs+=("$f") labels+=(--label "$(basename "$f" .jsonl)")
done
"$CUDA_AGENT_TRAINER_BIN" plot "${runs[@]}" "${labels[@]}" --out "$out/dynamics.png"
