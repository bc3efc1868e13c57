#!/usr/bin/env bash
# On a GPU machine: the final-evaluation harness on the hand-written CUDA candidates in
# skills/examples/cuda/<L{level}_{task}>.py. Builds them all in parallel (no device needed),
# then times eager, torch.compile and each candidate one after another, prints a table, and
# repeats the profile of one candidate REPEATS times to show the spread between runs.
# Uses $PYTHON (default python3, with torch); results go to ${OUT_DIR:-/tmp/harness-bench}.
# CANDIDATES="L1_16_LogSoftmax L2_2_Scale_Add_Tanh" limits the run to those candidates.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="${OUT_DIR:-/tmp/harness-bench}"
py="${PYTHON:-python3}"
repeats="${REPEATS:-10}"
repeat_candidate="${REPEAT_CANDIDATE:-L2_2_Scale_Add_Tanh}"
mkdir -p "$out"
export TORCH_EXTENSIONS_DIR="$out/ext"
task_of() { local n=$1 level=${1%%_*} rest=${1#*_}; echo "kernelbench/tasks/level${level#L}/$rest.py"; }
names=()
if [ -n "${CANDIDATES:-}" ]; then
  cands=(); for n in $CANDIDATES; do cands+=("skills/examples/cuda/$n.py"); done
else
  cands=(skills/examples/cuda/*.py)
fi
for cand in "${cands[@]}"; do
  name=$(basename "$cand" .py); names+=("$name")
  mkdir -p "$out/$name"; cp "$cand" "$out/$name/model_new.py"
  "$py" skills/evaluate.py candidate --task "$(task_of "$name")" --candidate "$out/$name" --device cuda --phase build > "$out/$name.build.json" &
done
wait
printf '| task | eager ms | compile ms | candidate ms | vs eager | vs compile | reward |\n| --- | --- | --- | --- | --- | --- | --- |\n'
for name in "${names[@]}"; do
  task=$(task_of "$name")
  "$py" skills/evaluate.py baseline --task "$task" --device cuda > "$out/$name.baseline.json"
  "$py" skills/evaluate.py candidate --task "$task" --candidate "$out/$name" --device cuda --phase run > "$out/$name.candidate.json"
  "$py" - "$out/$name.baseline.json" "$out/$name.candidate.json" "$name" <<'PY'
import json, sys
b = json.load(open(sys.argv[1])); c = json.load(open(sys.argv[2])); name = sys.argv[3]
e, k = b["eager"]["median_ms"], b["compile"]["median_ms"]
if not c.get("correct"):
    print(f"| {name} | {e:.4f} | {k:.4f} | - | - | - | -1 ({c.get('reason', '')[:200]}) |"); sys.exit()
t = c["candidate"]["median_ms"]
beats = lambda t, r: (r - t) / r > 0.05
reward = 3 if beats(t, e) and beats(t, k) else 2 if beats(t, e) else 1
print(f"| {name} | {e:.4f} | {k:.4f} | {t:.4f} | {e/t:.2f}x | {k/t:.2f}x | {reward} |")
PY
done
echo
for i in $(seq "$repeats"); do
  "$py" skills/evaluate.py candidate --task "$(task_of "$repeat_candidate")" --candidate "$out/$repeat_candidate" --device cuda --phase run
done > "$out/repeats.jsonl"
"$py" - "$out/repeats.jsonl" "$repeat_candidate" <<'PY'
import json, statistics, sys
meds = [json.loads(l)["candidate"]["median_ms"] for l in open(sys.argv[1]) if l.strip()]
m = statistics.fmean(meds); cv = statistics.stdev(meds) / m if len(meds) > 1 else 0.0
print(f"{sys.argv[2]}: {len(meds)} repeated profiles, median of each run: min {min(meds):.4f} ms, max {max(meds):.4f} ms, mean {m:.4f} ms, coefficient of variation {cv * 100:.2f}%")
PY
