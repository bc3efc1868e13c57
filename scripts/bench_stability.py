"""Milestone stability: one candidate evaluated N times by the final evaluation's judge, as the
server runs it (a fresh judge per evaluation, torch.compile timed), printing each evaluation's
reward, speedups and medians, and each contestant's spread across evaluations. The reward of
the same code should not flip between evaluations whenever its speedup is at least 3% away
from a milestone's threshold (1 / 0.95 = 1.053).

    python scripts/bench_stability.py --device cuda --evals 10 \\
        --candidate skills/examples/cuda/L2_2_Scale_Add_Tanh.py --task level2/2_Scale_Add_Tanh.py
    python scripts/bench_stability.py --device cpu --evals 4 --candidate ... --task ...

Runs without the sandbox around the judge, one evaluation at a time. With `--server`, through
a running env-server instead (POST /v1/evaluate), `--parallel K` submissions in flight at
once, each with a comment of its own (identical sources would be serialised by the server),
so that the timed evaluation has the next ones' start-up and builds beside it, as it does
under load:

    python scripts/bench_stability.py --server http://127.0.0.1:8080 --parallel 2 --evals 10 \\
        --candidate skills/examples/cuda/L2_2_Scale_Add_Tanh.py --task level2/2_Scale_Add_Tanh.py

The end says whether the run meets the bar: the same reward in at least 9 of 10 evaluations
whenever the median speedups are at least 3% away from the threshold.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "skills"))
sys.path.insert(0, str(ROOT / "scripts"))
from bench_aa import evaluate  # noqa: E402
from cuda_agent_judge import MILESTONE_MARGIN, milestone  # noqa: E402


def spread(xs: list[float]) -> str:
    """Median, and the range as a fraction of it."""
    if not xs:
        return "-"
    m = statistics.median(xs)
    return f"{m:.4f} ms ({(max(xs) - min(xs)) / m * 100:.1f}%)"


def task_id(task: str) -> str:
    """The server's id of a task file under kernelbench/tasks (`level2/2_X.py` -> `L2/2_X`)."""
    level, name = Path(task).parts[-2:]
    return f"L{level.removeprefix('level')}/{Path(name).stem}"


def server_evaluate(url: str, task: str, source: str, api_key: str | None, timeout: float) -> dict:
    """One evaluation through a running server's POST /v1/evaluate."""
    body = json.dumps({"task": task, "solution": source}).encode()
    req = urllib.request.Request(url.rstrip("/") + "/v1/evaluate", data=body, method="POST", headers={"Content-Type": "application/json"})
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        return {"correct": False, "rule": f"http_{e.code}", "reason": e.read().decode(errors="replace")[:400]}
    except (OSError, ValueError) as e:
        return {"correct": False, "rule": "request", "reason": str(e)[:400]}


def server_info(url: str, api_key: str | None) -> dict:
    req = urllib.request.Request(url.rstrip("/") + "/v1/info")
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read())
    except (OSError, ValueError):
        return {}


def verdict_of_run(rewards: list[int], speedups: dict, threshold: float) -> str:
    """Whether the run meets the bar: one reward in >= 90% of the evaluations whenever every
    median speedup is at least 3% from the threshold."""
    if not rewards:
        return "no evaluations"
    need = math.ceil(0.9 * len(rewards))
    top, n = Counter(rewards).most_common(1)[0]
    near = [k for k, xs in speedups.items() if xs and abs(statistics.median(xs) - threshold) / threshold < 0.03]
    if near:
        return f"not applicable: the median x {', x '.join(near)} is within 3% of the threshold {threshold:.3f} (reward {top} in {n} of {len(rewards)})"
    ok = n >= need
    return f"{'MEETS' if ok else 'FAILS'} the bar: reward {top} in {n} of {len(rewards)} (needs {need}), every median speedup at least 3% from {threshold:.3f}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--candidate", required=True, help="a model_new.py")
    p.add_argument("--task", required=True, help="its task, relative to kernelbench/tasks")
    p.add_argument("--device", default="cpu")
    p.add_argument("--size", choices=["small", "full"], help="task size (default: small on CPU, full on CUDA)")
    p.add_argument("--evals", type=int, default=10)
    p.add_argument("--budget-s", type=float, default=2.0)
    p.add_argument("--no-compile", action="store_true", help="leave torch.compile out (rewards then stop at 2)")
    p.add_argument("--skills", default=str(ROOT / "skills"), help="the judge's folder")
    p.add_argument("--json", help="also write every verdict here")
    p.add_argument("--server", help="evaluate through this env-server (its own device, sizes, budget and compile setting) instead of running the judge here")
    p.add_argument("--parallel", type=int, default=1, help="with --server, evaluations in flight at once")
    p.add_argument("--task-id", help="with --server, the server's task id (default: from --task, such as L2/2_Scale_Add_Tanh)")
    p.add_argument("--api-key", default=os.environ.get("CUDA_AGENT_API_KEY"), help="with --server, its bearer token")
    p.add_argument("--timeout-s", type=float, default=3600.0, help="with --server, the wait for one verdict")
    args = p.parse_args()
    threshold = 1.0 / (1.0 - MILESTONE_MARGIN)
    source = Path(args.candidate).read_text()
    work = Path(tempfile.mkdtemp(prefix="bench-stability-"))
    if args.server:
        info = server_info(args.server, args.api_key)
        tid = args.task_id or task_id(args.task)
        print(f"stability of {args.candidate} on {tid} through {args.server} ({info.get('device', '?')}, {', '.join(info.get('gpus') or []) or 'no GPU'}), {args.evals} evaluations, {args.parallel} at a time; a milestone needs a speedup above {threshold:.4f}", flush=True)
        judge = info.get("judge") or {}
        print(f"server: timing budget {judge.get('timing_budget_s')} s, compile baseline {judge.get('compile_baseline')}, prestart depth {(info.get('capacity') or {}).get('prestart_depth')}, timing isolation {json.dumps(info.get('timing_isolation'))}", flush=True)

        def run_one(i: int) -> dict:
            # A comment of its own: identical sources are evaluated one after another.
            return server_evaluate(args.server, tid, f"{source}\n# stability evaluation {i + 1} {time.time_ns()}\n", args.api_key, args.timeout_s)
    else:
        size = args.size or ("full" if args.device == "cuda" else "small")
        cand = work / "candidate"
        cand.mkdir()
        shutil.copy(args.candidate, cand / "model_new.py")
        task = ROOT / "kernelbench" / "tasks" / args.task
        env = dict(os.environ, CUDA_AGENT_TASK_SIZE=size, TORCH_EXTENSIONS_DIR=str(work / "torch_extensions"), PYTHONUNBUFFERED="1")
        env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
        extra = ["--budget-s", str(args.budget_s)] + (["--no-compile"] if args.no_compile else [])
        print(f"stability of {args.candidate} on {args.task} ({args.device}, size {size}), {args.evals} evaluations; a milestone needs a speedup above {threshold:.4f}", flush=True)

        def run_one(i: int) -> dict:
            return evaluate(Path(args.skills), task, cand, args.device, env, [], extra)

    print("| eval | reward | x eager | x compile | eager ms | compile ms | candidate ms | wall s |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    verdicts, rewards = [], []
    medians: dict = {"eager": [], "compile": [], "candidate": []}
    speedups: dict = {"eager": [], "compile": []}

    def record(i: int, r: dict, wall: float) -> None:
        verdicts.append({"eval": i + 1, "wall_s": wall, **r})
        if args.json:
            Path(args.json).write_text(json.dumps(verdicts, indent=1))
        if not r.get("correct"):
            rewards.append(-1)
            print(f"| {i + 1} | -1 | - | - | - | - | - | {wall:.0f} | {(r.get('rule') or '')}: {(r.get('reason') or '')[:120]}", flush=True)
            return
        t = r.get("times_ms") or {}
        s = r.get("speedup") or {}
        reward = milestone(True, t.get("candidate"), t.get("eager"), t.get("compile"))
        rewards.append(reward)
        for k in medians:
            if t.get(k) is not None:
                medians[k].append(t[k])
        for k in speedups:
            if s.get(k) is not None:
                speedups[k].append(s[k])

        def fmt(v, d=3):
            return "-" if v is None else f"{v:.{d}f}"

        print(f"| {i + 1} | {reward} | {fmt(s.get('eager'))} | {fmt(s.get('compile'))} | {fmt(t.get('eager'), 4)} | {fmt(t.get('compile'), 4)} | {fmt(t.get('candidate'), 4)} | {wall:.0f} |", flush=True)

    if args.server and args.parallel > 1:
        with concurrent.futures.ThreadPoolExecutor(max_workers=args.parallel) as pool:
            started = {}
            for i in range(args.evals):
                started[pool.submit(run_one, i)] = (i, time.perf_counter())
            for f in concurrent.futures.as_completed(started):
                i, t0 = started[f]
                record(i, f.result(), time.perf_counter() - t0)
    else:
        for i in range(args.evals):
            t0 = time.perf_counter()
            r = run_one(i)
            record(i, r, time.perf_counter() - t0)
    print()
    counts = Counter(rewards)
    top, n = counts.most_common(1)[0] if counts else (None, 0)
    print(f"rewards: {dict(sorted(counts.items()))}; the most common ({top}) in {n} of {len(rewards)}")
    for k, xs in speedups.items():
        if xs:
            near = abs(statistics.median(xs) - threshold) / threshold * 100
            print(f"x {k}: median {statistics.median(xs):.3f}, range {min(xs):.3f}-{max(xs):.3f}; the median is {near:.1f}% from the threshold")
    for k, xs in medians.items():
        print(f"{k} median across evaluations: {spread(xs)}")
    print(verdict_of_run(rewards, speedups, threshold))
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
