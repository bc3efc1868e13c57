#!/usr/bin/env bash
# The split judge's checks on a CUDA machine, run side by side, every log kept:
#   1. the CUDA red-team cases through a release env-server's POST /v1/evaluate (the production
#      path: sandbox, worker uid, CUDA IPC across uids), torch.compile skipped (verdicts only);
#   2. scripts/gpu_e2e.py: one episode (nvcc, verify.py, profile.py in the sandbox, submit) and
#      /v1/evaluate of every example candidate, on a second server;
#   3. scripts/bench_agent_loop.py --device cuda: verify.py and profile.py per build layout
#      (AGENT_LOOP=0 leaves it out).
# Usage: scripts/gpu_judge_check.sh OUT_DIR [SECONDS]   (env-server from target/release)
set -u
out=${1:?usage: gpu_judge_check.sh OUT_DIR [SECONDS]}
limit=${2:-480}
mkdir -p "$out/logs"
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
export PYTHONUNBUFFERED=1 CUDA_AGENT_PYTHON=${CUDA_AGENT_PYTHON:-python3}
server=${SERVER:-target/release/env-server}
nvidia-smi -L
$CUDA_AGENT_PYTHON -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name(0))'
port=18300
data=$(mktemp -d /tmp/judge-check-XXXX)
chmod 711 "$data"
"$server" --bind 127.0.0.1:$port --data-dir "$data/data" --python "$(command -v $CUDA_AGENT_PYTHON)" --device cuda --skip-compile \
    >"$out/logs/redteam_server.log" 2>&1 &
spid=$!
for _ in $(seq 600); do (exec 3<>/dev/tcp/127.0.0.1/$port) 2>/dev/null && break; sleep 0.1; done
curl -s http://127.0.0.1:$port/v1/info | head -c 3000; echo
# The legitimate cases first: they were the ones a time limit cut twice (each case is a
# fresh nvcc build, about two minutes with three at once).
mapfile -t cases < <(grep -o '^name = "cuda_[a-z0-9_]*"' tests/redteam/cases.toml | cut -d'"' -f2 | awk '/^cuda_legit_/ {print; next} {rest[n++]=$0} END {for (i = 0; i < n; i++) print rest[i]}')
groups=3
pids=()
for g in $(seq 0 $((groups - 1))); do
    names=()
    for i in "${!cases[@]}"; do [ $((i % groups)) = "$g" ] && names+=("${cases[$i]}"); done
    timeout "$limit" $CUDA_AGENT_PYTHON tests/redteam/table.py --server http://127.0.0.1:$port --names "${names[@]}" \
        --json "$out/logs/redteam_$g.json" >"$out/logs/redteam_$g.md" 2>"$out/logs/redteam_$g.log" &
    pids+=($!)
done
# 3. The agent's loop in a workspace (nvcc): verify.py and profile.py per build layout.
AGENT_LOOP=${AGENT_LOOP:-1}
if [ "$AGENT_LOOP" = 1 ]; then
    timeout "$limit" $CUDA_AGENT_PYTHON scripts/bench_agent_loop.py --device cuda --json "$out/logs/agent_loop.json" \
        >"$out/logs/agent_loop.md" 2>"$out/logs/agent_loop.log" &
    pids+=($!)
fi
timeout "$limit" $CUDA_AGENT_PYTHON scripts/gpu_e2e.py --server "$server" --parallel 6 --log "$out/logs/e2e_server.log" \
    --json "$out/logs/e2e.json" >"$out/logs/e2e.log" 2>&1 &
pids+=($!)
# Progress as it comes: each case's verdict line, the e2e table's rows.
tail -q -n +1 -F "$out"/logs/redteam_*.log "$out/logs/e2e.log" "$out/logs/agent_loop.log" 2>/dev/null | cut -c1-300 &
tpid=$!
wait "${pids[@]}"
sleep 1
kill $tpid $spid 2>/dev/null
echo "=== red team"; cat "$out"/logs/redteam_*.md
echo "=== e2e"; cat "$out/logs/e2e.log" | cut -c1-400 | tail -60
echo "=== agent loop"; cat "$out/logs/agent_loop.md" 2>/dev/null
tar -C "$out" -czf "$out/logs.tgz" logs && rm -rf "$out/logs"
