#!/usr/bin/env bash
# The judge's numbers on a CUDA machine, in one go, every table kept under OUT_DIR:
#   1. peak memory of the five largest bundled tasks (tests/gpu/candidates/ + L1_2_Add) and of
#      one KernelBench-sized input (relu 4096 x 393216), torch.compile off, side by side
#      (memory is per process; times of this phase are those of a shared GPU);
#   2. the example candidates with torch.compile, this judge and the single-process harness
#      before the split (`--before`, default .before/skills when it exists), one at a time;
#   3. evaluation throughput through the release server (N distinct candidates, default 32),
#      prestart on then off.
# Each phase stops at its share of SECONDS (default 540) and prints its table as it goes.
# Usage: [N=32] scripts/gpu_judge_bench.sh OUT_DIR [SECONDS] [BEFORE_SKILLS_DIR]
set -u
out=${1:?usage: gpu_judge_bench.sh OUT_DIR [SECONDS] [BEFORE_SKILLS_DIR]}
total=${2:-540}
before=${3:-.before/skills}
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 CUDA_AGENT_PYTHON=${CUDA_AGENT_PYTHON:-python3}
py=$CUDA_AGENT_PYTHON
t0=$(date +%s)
left() { echo $((total - ($(date +%s) - t0))); }

echo "== 1. memory (side by side)"
timeout $((total * 35 / 100)) $py scripts/bench_judge.py --device cuda --no-compile \
    --candidates tests/gpu/candidates/*.py skills/examples/cuda/L1_2_Add.py \
    --json "$out/memory.json" >"$out/memory.md" 2>"$out/memory.log" &
m1=$!
timeout $((total * 35 / 100)) $py scripts/bench_judge.py --device cuda --no-compile \
    --candidates skills/examples/cuda/L1_1_ReLU.py --task tests/gpu/tasks/relu_4096x393216.py \
    --json "$out/kernelbench_size.json" >"$out/kernelbench_size.md" 2>"$out/kernelbench_size.log" &
m2=$!
wait $m1 $m2
cat "$out/memory.md" "$out/kernelbench_size.md"
tail -n 3 "$out/memory.log" "$out/kernelbench_size.log"

echo "== 2. examples with torch.compile, before and after ($(left) s left)"
ba=()
[ -d "$before" ] && ba=(--before "$before")
timeout $(($(left) * 55 / 100)) $py scripts/bench_judge.py --device cuda "${ba[@]}" \
    --json "$out/examples.json" 2>&1 | tee "$out/examples.md"

echo "== 3. throughput through the server ($(left) s left)"
n=${N:-32}
port=18290
for mode in on off; do
    budget=$(($(left) / 2))
    [ "$mode" = off ] && budget=$(left)
    [ "$budget" -lt 60 ] && { echo "no time left for prestart $mode"; continue; }
    port=$((port + 1))
    timeout "$budget" $py scripts/bench_eval_throughput.py --device cuda --n "$n" --concurrency "$n" \
        --prestart "$mode" --port "$port" 2>&1 | tee "$out/throughput_prestart_$mode.md"
    # A run cut by its time limit leaves its server behind: it would hold the GPU.
    pkill -f "env-server --bind 127.0.0.1:$port" 2>/dev/null
done
echo "== done in $(($(date +%s) - t0)) s"
