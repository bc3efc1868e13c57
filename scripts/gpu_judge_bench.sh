#!/usr/bin/env bash
# The judge's numbers on a CUDA machine, in one go, every table kept under OUT_DIR:
#   1. peak memory of the five largest bundled tasks (tests/gpu/candidates/ + L1_2_Add) and of
#      one KernelBench-sized input (relu 4096 x 393216), torch.compile off, side by side
#      (memory is per process; times of this phase are those of a shared GPU);
#   2. the example candidates with torch.compile, this judge and the single-process harness
#      before the split (`--before`, default .before/skills when it exists), one at a time;
#   3. evaluation throughput through the release server, prestart on then off: the examples
#      built once (not counted), then N evaluations of them (default 12), every one judged in
#      full; the device side's rate once builds run ahead of the lease.
# PHASES (default "1 2 3") picks phases; each stops at its share of SECONDS (default 540) and
# prints its table as it goes. Phase 3 takes MODES (default "on off"; also "unobserved") and PCH.
# Phase "observe" (asked for by name, run before 3) sends red-team cases through a CUDA server
# and prints the outside observation of each (OBSERVE_CASES, OBSERVE_JOBS in flight).
# Usage: [PHASES="1 2"] [N=12] scripts/gpu_judge_bench.sh OUT_DIR [SECONDS] [BEFORE_SKILLS_DIR]
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
phases=${PHASES:-1 2 3}
want() { [[ " $phases " == *" $1 "* ]]; }
# A phase's share of the time: all that is left when it is the last one asked for.
share() { if [ "${2:-}" = last ]; then left; else echo $(($(left) * $1 / 100)); fi; }

if want 1; then
last=; want 2 || want 3 || last=last
echo "== 1. memory (side by side)"
timeout $(share 35 $last) $py scripts/bench_judge.py --device cuda --no-compile \
    --candidates tests/gpu/candidates/*.py skills/examples/cuda/L1_2_Add.py \
    --json "$out/memory.json" >"$out/memory.md" 2>"$out/memory.log" &
m1=$!
timeout $(share 35 $last) $py scripts/bench_judge.py --device cuda --no-compile \
    --candidates skills/examples/cuda/L1_1_ReLU.py --task tests/gpu/tasks/relu_4096x393216.py \
    --json "$out/kernelbench_size.json" >"$out/kernelbench_size.md" 2>"$out/kernelbench_size.log" &
m2=$!
wait $m1 $m2
cat "$out/memory.md" "$out/kernelbench_size.md"
tail -n 3 "$out/memory.log" "$out/kernelbench_size.log"
fi

if want 2; then
last=; want 3 || last=last
echo "== 2. examples with torch.compile, before and after ($(left) s left)"
ba=()
[ -d "$before" ] && ba=(--before "$before")
timeout $(share 55 $last) $py scripts/bench_judge.py --device cuda "${ba[@]}" \
    --json "$out/examples.json" 2>&1 | tee "$out/examples.md"

fi

if want observe; then
echo "== observe. the outside observation of hidden compute on CUDA ($(left) s left)"
# Cases (OBSERVE_CASES, default the dispatch-modes add) through a CUDA server, torch.compile
# skipped; prints what the server's observation saw of each (reported on CUDA, not judged).
oport=18280
olast=; want 3 || olast=last
odata=$(mktemp -d /tmp/observe-XXXX)
chmod 711 "$odata"
target/release/env-server --bind 127.0.0.1:$oport --data-dir "$odata/data" --python "$(command -v "$py")" \
    --device cuda --skip-compile >"$out/observe_server.log" 2>&1 &
opid=$!
for _ in $(seq 600); do (exec 3<>/dev/tcp/127.0.0.1/$oport) 2>/dev/null && break; sleep 0.1; done
# Beside it (BUILD_PATHS=1, the default), what each build path costs on this host (a CUDA
# kernel without torch headers, NVRTC).
bpid=
if [ "${BUILD_PATHS:-1}" = 1 ]; then
    timeout $(share 30) $py scripts/bench_build_paths.py --repeat 1 --cuda >"$out/build_paths.md" 2>"$out/build_paths.log" &
    bpid=$!
fi
# OBSERVE_JOBS cases in flight: their builds run at once, the server times one at a time.
timeout $(share 30 $olast) $py tests/redteam/table.py --server http://127.0.0.1:$oport --jobs ${OBSERVE_JOBS:-8} \
    --names ${OBSERVE_CASES:-cuda_hidden_add_obfuscated cuda_legit_nvrtc_kernel} --json "$out/observe.json" 2>&1 | tee "$out/observe.md"
kill $opid 2>/dev/null
if [ -n "$bpid" ]; then
    wait $bpid
    cat "$out/build_paths.md"; tail -n 5 "$out/build_paths.log"
fi
$py -c 'import json, sys; sys.path.insert(0, "scripts"); from bench_eval_throughput import observed
observed([(name, 0, r["result"]) for name, r in json.load(open(sys.argv[1])).items()])' "$out/observe.json"
fi

if want 3; then
echo "== 3. throughput through the server ($(left) s left)"
n=${N:-12}
port=18290
tdata=$(mktemp -d /tmp/throughput-XXXX)
# MODES: "on" prestart on, "off" prestart off, "unobserved" prestart on without the outside
# observation (--no-observe); the first run builds the examples (not counted), the rest reuse
# its build cache. PCH passes the server's --pch (say "none": the warm-up's builds are not
# counted, and making the headers costs about a minute).
modes=(${MODES:-on off})
pch=()
[ -n "${PCH:-}" ] && pch=(--pch="$PCH")
for i in "${!modes[@]}"; do
    mode=${modes[$i]}
    # The first run also builds: twice a later run's share.
    budget=$(($(left) / (${#modes[@]} - i)))
    [ "$i" -eq 0 ] && budget=$(($(left) * 2 / (${#modes[@]} + 1)))
    warm=()
    [ "$i" -gt 0 ] && warm=(--no-warm-up)
    extra=(--prestart on)
    case $mode in
        off) extra=(--prestart off) ;;
        unobserved) extra=(--prestart on --server-arg=--no-observe) ;;
    esac
    [ "$budget" -lt 60 ] && { echo "no time left for $mode"; continue; }
    port=$((port + 1))
    echo "-- $mode ($budget s)"
    timeout "$budget" $py scripts/bench_eval_throughput.py --device cuda --n "$n" --concurrency "$n" \
        --warm-builds "${warm[@]}" "${pch[@]}" --data-dir "$tdata" "${extra[@]}" --port "$port" \
        --json "$out/throughput_$mode.json" 2>&1 | tee "$out/throughput_$mode.md"
    # A run cut by its time limit leaves its server behind: it would hold the GPU.
    pkill -f "env-server --bind 127.0.0.1:$port" 2>/dev/null
    cp "$tdata/server.log" "$out/throughput_server_$mode.log" 2>/dev/null
done
fi
echo "== done in $(($(date +%s) - t0)) s"
