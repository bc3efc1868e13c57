#!/usr/bin/env bash
# On a GPU machine: the final-evaluation harness on hand-written CUDA candidates
# (skills/examples/cuda/<task>.py), printing eager / compile / candidate times and rewards.
# Uses the python3 on PATH (with torch); writes JSON results to ${OUT_DIR:-/tmp/harness-bench}.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="${OUT_DIR:-/tmp/harness-bench}"
mkdir -p "$out"
export TORCH_EXTENSIONS_DIR="$out/ext"
py="${PYTHON:-python3}"
printf '| task | eager ms | compile ms | candidate ms | vs eager | vs compile | reward |\n| --- | --- | --- | --- | --- | --- | --- |\n'
for cand in skills/examples/cuda/*.py; do
  name=$(basename "$cand" .py)                 # L1_2_Add -> level1/2_Add.py
  level=${name%%_*}; rest=${name#*_}
  task="kernelbench/tasks/level${level#L}/$rest.py"
  dir="$out/$name"; mkdir -p "$dir"; cp "$cand" "$dir/model_new.py"
  "$py" skills/evaluate.py baseline --task "$task" --device cuda > "$out/$name.baseline.json"
  "$py" skills/evaluate.py candidate --task "$task" --candidate "$dir" --device cuda > "$out/$name.candidate.json"
  "$py" - "$out/$name.baseline.json" "$out/$name.candidate.json" "$name" <<'PY'
import json, sys
b = json.load(open(sys.argv[1])); c = json.load(open(sys.argv[2])); name = sys.argv[3]
e, k = b["eager"]["median_ms"], b["compile"]["median_ms"]
if not c.get("correct"):
    print(f"| {name} | {e:.4f} | {k:.4f} | - | - | - | -1 ({c.get('reason')}) |"); sys.exit()
t = c["candidate"]["median_ms"]
beats = lambda t, r: (r - t) / r > 0.05
reward = 3 if beats(t, e) and beats(t, k) else 2 if beats(t, e) else 1
print(f"| {name} | {e:.4f} | {k:.4f} | {t:.4f} | {e/t:.2f}x | {k/t:.2f}x | {reward} |")
PY
done
