#!/usr/bin/env bash
# On a GPU machine: the trainer's CUDA path, measured.
#
#   scripts/bench_gpu_trainer.sh model   # burn vs PyTorch on Qwen2.5-0.5B's shape (bf16)
#   scripts/bench_gpu_trainer.sh loop    # warm-up and PPO steps against env-server on CUDA
#
# Takes release binaries built elsewhere: $TRAINER (built with `--features cuda`, default
# target/release/trainer) and $SERVER (default target/release/env-server); $PYTHON (default
# python3) holds torch and transformers. Results go to ${OUT_DIR:-/tmp/trainer-bench}.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
mode="${1:?usage: bench_gpu_trainer.sh model|loop}"
out="${OUT_DIR:-/tmp/trainer-bench}"
trainer="${TRAINER:-target/release/trainer}"
server="${SERVER:-target/release/env-server}"
py="${PYTHON:-python3}"
mkdir -p "$out"
# NVLink multicast stays off: on shared hosts it can take GPUs out of service.
export NCCL_NVLS_ENABLE=0
# The trainer hands matrix products to cuBLAS, loaded at run time: when the loader does not
# list it, use the CUDA toolkit's copy or the one PyTorch's wheels bring.
if ! ldconfig -p 2>/dev/null | grep -q 'libcublas\.so'; then
  for d in /usr/local/cuda/lib64 /usr/local/cuda*/targets/x86_64-linux/lib \
           "$("$py" -c 'import nvidia, os; print(os.path.join(nvidia.__path__[0], "cu13", "lib"))' 2>/dev/null)"; do
    if [ -n "$d" ] && ls "$d"/libcublas.so.* >/dev/null 2>&1; then
      export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
      break
    fi
  done
fi

case "$mode" in
model)
  args=(--seq "${SEQ:-2048}" --train-batch "${TRAIN_BATCH:-4}" --train-iters 5 --gen-batch "${GEN_BATCH:-1,32}" --prompt 128 --new-tokens "${NEW_TOKENS:-128}")
  RUST_LOG="${RUST_LOG:-info}" timeout "${BURN_TIMEOUT:-300}" "$trainer" bench-model --device cuda --precision bf16 "${args[@]}" > "$out/bench_burn.json" 2> "$out/bench_burn.log" || { echo "burn bench failed:"; tail -20 "$out/bench_burn.log"; }
  timeout 180 "$py" scripts/bench_model_torch.py --dtype bf16 "${args[@]}" > "$out/bench_torch.json" 2> "$out/bench_torch.log" || { echo "torch bench failed:"; tail -20 "$out/bench_torch.log"; }
  if [ -s "$out/bench_burn.json" ] && [ -s "$out/bench_torch.json" ]; then
    "$py" scripts/bench_model_table.py "$out/bench_burn.json" "$out/bench_torch.json" | tee "$out/bench_model.md"
  fi
  ;;
loop)
  model="$out/model"
  mkdir -p "$model"
  cp trainer/assets/tiny-tokenizer.json "$model/tokenizer.json"
  # A 25M-parameter Qwen2-shaped policy (random weights): big enough to load the GPU, small
  # enough that a step's time is the loop's, not one huge model's.
  cat > "$model/config.json" <<'JSON'
{"model_type": "qwen2", "vocab_size": 512, "hidden_size": 512, "intermediate_size": 1536,
 "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 2,
 "max_position_embeddings": 8192, "rope_theta": 10000.0, "tie_word_embeddings": true, "eos_token_id": 2}
JSON
  port=18431
  # Sandboxed tools must reach the data directory, so it lives outside $out (which may sit in a
  # home directory others cannot search).
  data="${DATA_DIR:-/tmp/trainer-bench-data}"
  rm -rf "$data"
  "$server" --bind "127.0.0.1:$port" --data-dir "$data" --python "$py" --device cuda --skip-compile --allow-unconfined > "$out/server.log" 2>&1 &
  spid=$!
  trap 'kill $spid 2>/dev/null || true' EXIT
  for _ in $(seq 120); do curl -sf "http://127.0.0.1:$port/v1/health" >/dev/null && break; sleep 0.5; done
  curl -sf "http://127.0.0.1:$port/v1/info" > "$out/server_info.json" || true
  cat > "$out/train.toml" <<TOML
[model]
path = "$model"
random_init = true

[server]
urls = ["http://127.0.0.1:$port"]
timeout_s = 600
concurrency = 16

[rollout]
split = "level1"
batch = ${BATCH:-16}
max_turns = 2
temperature = 1.0
max_turn_tokens = 128
context = 8192
single_turn_context = 8192
tools_in_prompt = false
generation_batch = 16

[optim]
actor_lr = 1e-5
critic_lr = 1e-5
micro_batch = 4

[ppo]
steps = ${STEPS:-20}
minibatch = 16
epochs = 1

[run]
out_dir = "$out/runs"
checkpoint_every = 100
seed = 0
TOML
  for stage in ${STAGES:-warmup ppo}; do
    s=$(date +%s%N)
    timeout "${STAGE_TIMEOUT:-200}" "$trainer" "$stage" --config "$out/train.toml" --device cuda --precision f32 > "$out/$stage.out" 2> "$out/$stage.log" \
      || { echo "$stage failed or timed out:"; tail -15 "$out/$stage.log"; }
    echo "$stage: $(( ($(date +%s%N) - s) / 1000000 )) ms wall"
  done
  "$py" - "$out/runs" <<'PY'
import json, pathlib, sys
root = pathlib.Path(sys.argv[1])
print("| stage | step | episodes | tokens/episode | reward | episodes/min | tokens/min | rollout s | generate s | env s | update s |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
for stage in ("warmup", "ppo"):
    f = root / stage / "metrics.jsonl"
    if not f.exists():
        continue
    for line in f.read_text().splitlines():
        d = json.loads(line); t = d.get("time_s", {})
        print(f"| {stage} | {d['step']} | {d['episodes']} | {d['tokens_per_episode']:.0f} | {d['reward_mean']:.2f} | "
              f"{d['episodes_per_min']:.1f} | {d['tokens_per_min']:,.0f} | {t.get('rollout', 0):.1f} | {t.get('generate', 0):.1f} | "
              f"{t.get('env', 0):.1f} | {t.get('update', 0):.1f} |")
PY
  ;;
*) echo "unknown mode $mode" >&2; exit 2 ;;
esac
