#!/usr/bin/env bash
# The learning test's recipe (tests/learning.rs: demonstrations, RFT, value pre-training,
# multi-turn PPO on the `tiny` split, CPU) run with every weight trained and with adapters
# (RANKS: 0 trains every weight; N > 0 trains rank-N adapters in the stages after RFT, on
# RFT's weights, as the test's LEARNING_LORA_RANK says why), for several seeds: prints the
# mean rewards per run as a table and draws the RFT and PPO curves of all runs on one figure
# each (trainer plot).
#
#   scripts/bench_learning.sh [OUT_DIR]     (RANKS="0 16" SEEDS="0 1" by default)
#
# Needs the release trainer (cargo build --release -p trainer, or CUDA_AGENT_TRAINER_BIN) and
# the test venv (scripts/python-env.sh); each run takes about four minutes on two cores.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="${1:-target/bench-learning}"
ranks="${RANKS:-0 16}"
seeds="${SEEDS:-0 1}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
# shellcheck source=scripts/learning-env.sh
. scripts/learning-env.sh
echo "| run | random | after RFT | after PPO | wall s |"
echo "|---|---:|---:|---:|---:|"
ppo=() rft=() labels=()
for rank in $ranks; do
  for seed in $seeds; do
    name="$([ "$rank" = 0 ] && echo full || echo "lora$rank")-seed$seed"
    log="$out/$name.log"
    start=$SECONDS
    LEARNING_KEEP=1 LEARNING_SEED="$seed" LEARNING_LORA_RANK="$rank" \
      cargo test --locked -p e2e-tests --test learning -- --nocapture > "$log" 2>&1 || echo "$name: the test failed (see $log)" >&2
    dir="$(sed -n 's/^run directory kept: //p' "$log" | tail -1)"
    line="$(grep -o 'mean reward random .*' "$log" | tail -1 || true)"
    read -r before after_rft after <<<"$(echo "$line" | sed -E 's/mean reward random ([-0-9.]+), after RFT ([-0-9.]+), after PPO ([-0-9.]+)/\1 \2 \3/')"
    echo "| $name | ${before:--} | ${after_rft:--} | ${after:--} | $((SECONDS - start)) |"
    if [ -n "$dir" ] && [ -f "$dir/runs/ppo/metrics.jsonl" ]; then
      mkdir -p "$out/$name"
      cp "$dir/runs/ppo/metrics.jsonl" "$out/$name/ppo.jsonl"
      cp "$dir/runs/rft/metrics.jsonl" "$out/$name/rft.jsonl"
      rm -rf "$dir"
      ppo+=("$out/$name/ppo.jsonl") rft+=("$out/$name/rft.jsonl") labels+=(--label "$name")
    fi
  done
done
if [ "${#ppo[@]}" -gt 0 ]; then
  "$CUDA_AGENT_TRAINER_BIN" plot "${ppo[@]}" "${labels[@]}" --out "$out/ppo.png"
  "$CUDA_AGENT_TRAINER_BIN" plot "${rft[@]}" "${labels[@]}" --out "$out/rft.png"
fi
