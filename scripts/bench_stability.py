"""Milestone stability: one candidate evaluated N times by the final evaluation's judge, as the
server runs it (a fresh judge per evaluation, torch.compile timed), printing each evaluation's
reward, speedups and medians, and each contestant's spread across evaluations. The reward of
the same code should not flip between evaluations whenever its speedup is at least 3% away
from a milestone's threshold (1 / 0.95 = 1.053).

    python scripts/bench_stability.py --device cuda --evals 10 \\
        --candidate skills/examples/cuda/L2_2_Scale_Add_Tanh.py --task level2/2_Scale_Add_Tanh.py
    python scripts/bench_stability.py --device cpu --evals 4 --candidate ... --task ...

Runs without the sandbox around the judge, one evaluation at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
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
    args = p.parse_args()
    size = args.size or ("full" if args.device == "cuda" else "small")
    work = Path(tempfile.mkdtemp(prefix="bench-stability-"))
    cand = work / "candidate"
    cand.mkdir()
    shutil.copy(args.candidate, cand / "model_new.py")
    task = ROOT / "kernelbench" / "tasks" / args.task
    env = dict(os.environ, CUDA_AGENT_TASK_SIZE=size, TORCH_EXTENSIONS_DIR=str(work / "torch_extensions"), PYTHONUNBUFFERED="1")
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    extra = ["--budget-s", str(args.budget_s)] + (["--no-compile"] if args.no_compile else [])
    threshold = 1.0 / (1.0 - MILESTONE_MARGIN)
    print(f"stability of {args.candidate} on {args.task} ({args.device}, size {size}), {args.evals} evaluations; a milestone needs a speedup above {threshold:.4f}", flush=True)
    print("| eval | reward | x eager | x compile | eager ms | compile ms | candidate ms | wall s |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    verdicts, rewards = [], []
    medians: dict = {"eager": [], "compile": [], "candidate": []}
    speedups: dict = {"eager": [], "compile": []}
    for i in range(args.evals):
        t0 = time.perf_counter()
        r = evaluate(Path(args.skills), task, cand, args.device, env, [], extra)
        wall = time.perf_counter() - t0
        verdicts.append({"eval": i + 1, "wall_s": wall, **r})
        if args.json:
            Path(args.json).write_text(json.dumps(verdicts, indent=1))
        if not r.get("correct"):
            rewards.append(-1)
            print(f"| {i + 1} | -1 | - | - | - | - | - | {wall:.0f} | {(r.get('rule') or '')}: {(r.get('reason') or '')[:120]}", flush=True)
            continue
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
    print()
    counts = Counter(rewards)
    top, n = counts.most_common(1)[0] if counts else (None, 0)
    print(f"rewards: {dict(sorted(counts.items()))}; the most common ({top}) in {n} of {len(rewards)}")
    for k, xs in speedups.items():
        if xs:
            near = min(abs(x - threshold) for x in xs) / threshold * 100
            print(f"x {k}: median {statistics.median(xs):.3f}, range {min(xs):.3f}-{max(xs):.3f}; nearest to the threshold: {near:.1f}% away")
    for k, xs in medians.items():
        print(f"{k} median across evaluations: {spread(xs)}")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
