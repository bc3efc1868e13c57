"""The judge measured: for each candidate, its verdict, the three medians with the speedups'
noise bands, the evaluation's wall time with the build excluded, and the peak memory of the
judge and both workers. Prints a Markdown table (for docs/BENCHMARKS.md).

    python scripts/bench_judge.py --device cuda                      # skills/examples/cuda/*
    python scripts/bench_judge.py --device cpu                       # the CPU add candidate
    python scripts/bench_judge.py --device cuda --candidates skills/examples/cuda/L1_2_Add.py
                                  --size full --repeat 3 --no-compile

A candidate file named `L<level>_<n>_<Name>.py` is judged on kernelbench/tasks/level<level>/
<n>_<Name>.py; `--task` names the task for all of them instead. Each candidate is built once
first (the worker's `build`, all side by side, timed apart), then judged `--repeat` times in fresh processes.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKILLS = ROOT / "skills"


def task_for(candidate: Path, task: str | None) -> Path:
    if task:
        return Path(task)
    m = re.match(r"L(\d+)_(\d+_.+)\.py$", candidate.name)
    if not m:
        raise SystemExit(f"{candidate.name}: name it L<level>_<n>_<Name>.py or pass --task")
    return ROOT / "kernelbench" / "tasks" / f"level{m.group(1)}" / f"{m.group(2)}.py"


def gib(n) -> str:
    return "-" if n is None else f"{n / (1 << 30):.2f}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto")
    p.add_argument("--candidates", nargs="*", help="model_new.py files (default: the examples of the device)")
    p.add_argument("--task", help="one task for every candidate")
    p.add_argument("--size", choices=["small", "full"], help="task size (default: small on CPU, full on CUDA)")
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--budget-s", type=float, default=2.0)
    p.add_argument("--json", help="also write every verdict here")
    p.add_argument("--before", help="also run each candidate through this older single-process skills/ folder (evaluate.py baseline + candidate) for a before/after table")
    p.add_argument("--parallel-builds", type=int, default=os.cpu_count() or 1, help="candidates built at once")
    args = p.parse_args()
    device = args.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    cands = [Path(c) for c in args.candidates] if args.candidates else (
        sorted((SKILLS / "examples" / "cuda").glob("L*.py")) if device == "cuda" else [ROOT / "tests" / "cpu_add_candidate_torch_headers.py"])
    task_default = args.task or (None if device == "cuda" or args.candidates else str(ROOT / "kernelbench/tasks/level1/2_Add.py"))
    size = args.size or ("full" if device == "cuda" else "small")
    work = Path(tempfile.mkdtemp(prefix="bench-judge-"))
    env = dict(os.environ, CUDA_AGENT_TASK_SIZE=size, TORCH_EXTENSIONS_DIR=str(work / "torch_extensions"), PYTHONUNBUFFERED="1")
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")  # ninja lives in the venv
    rows, verdicts = [], []
    print(f"device {device}, task size {size}, {args.repeat} run(s) each, compile {'off' if args.no_compile else 'on'}", flush=True)
    # Every candidate is built first, side by side (nvcc is most of a CUDA build and runs on one
    # core), then judged one at a time on a quiet device.
    dirs = {}
    for cand in cands:
        cdir = work / cand.stem
        cdir.mkdir()
        shutil.copy(cand, cdir / "model_new.py")
        dirs[cand] = cdir

    def build(cand):
        t0 = time.perf_counter()
        b = subprocess.run([sys.executable, str(SKILLS / "cuda_agent_worker.py"), "build", "--task", str(task_for(cand, task_default)), "--candidate", str(dirs[cand]),
                            "--device", device], capture_output=True, text=True, env=env)
        if b.returncode != 0:
            print(f"{cand.name}: build failed\n{b.stdout[-2000:]}{b.stderr[-2000:]}", file=sys.stderr, flush=True)
        return time.perf_counter() - t0

    with concurrent.futures.ThreadPoolExecutor(max(1, args.parallel_builds)) as pool:
        build_secs = dict(zip(cands, pool.map(build, cands)))
    print("built: " + ", ".join(f"{c.stem} {s:.0f} s" for c, s in build_secs.items()), flush=True)
    for cand in cands:
        task = task_for(cand, task_default)
        cdir = dirs[cand]
        build_s = build_secs[cand]
        walls, last = [], None
        for _ in range(args.repeat):
            cmd = [sys.executable, str(SKILLS / "evaluate.py"), "candidate", "--task", str(task), "--candidate", str(cdir), "--device", device,
                   "--budget-s", str(args.budget_s)] + (["--no-compile"] if args.no_compile else [])
            t0 = time.perf_counter()
            out = subprocess.run(cmd, capture_output=True, text=True, env=env)
            walls.append(time.perf_counter() - t0)
            lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
            last = json.loads(lines[-1]) if lines else {"correct": False, "reason": out.stderr[-500:]}
            verdicts.append({"candidate": cand.name, "task": str(task), "build_s": build_s, "wall_s": walls[-1], **last})
            if args.json:  # kept current, so an interrupted run keeps what it did
                Path(args.json).write_text(json.dumps(verdicts, indent=1))
        r = last
        if r.get("correct"):
            t = r["times_ms"]
            sp = r.get("speedup", {})
            band = r.get("noise_band", {})
            mem = r["details"].get("memory", {})
            key = "peak_cuda_bytes" if device == "cuda" else "peak_rss_bytes"
            wkey = "peak_cuda_reserved_bytes" if device == "cuda" else "peak_rss_bytes"

            def fmt(base):
                if base not in sp:
                    return "-"
                lo, hi = band[base]
                return f"{sp[base]:.2f} ({lo:.2f}-{hi:.2f})"

            rows.append([cand.stem, f"correct, reward {reward(t.get('candidate'), t.get('eager'), t.get('compile')):.0f}", f"{t['eager']:.3f}", f"{t['compile']:.3f}" if t.get("compile") else "-", f"{t['candidate']:.3f}",
                         fmt("eager"), fmt("compile"), f"{build_s:.1f}", f"{statistics.median(walls):.1f}",
                         gib(mem.get("judge", {}).get(key)), gib(mem.get("reference_worker", {}).get(wkey)), gib(mem.get("candidate_worker", {}).get(wkey))])
        else:
            rows.append([cand.stem, (r.get("reason") or "?")[:60].replace("|", "/"), "-", "-", "-", "-", "-", f"{build_s:.1f}", f"{statistics.median(walls):.1f}", "-", "-", "-"])
        print("| " + " | ".join(rows[-1]) + " |", flush=True)
    unit = "GPU GiB" if device == "cuda" else "RSS GiB"
    print()
    print(f"| candidate | verdict | eager ms | compile ms | candidate ms | x eager (90% band) | x compile (90% band) | build s | judge wall s | judge {unit} | reference {unit} | candidate {unit} |")
    print("|" + " --- |" * 12)
    for row in rows:
        print("| " + " | ".join(row) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(verdicts, indent=1))
    if args.before:
        before(Path(args.before), cands, dirs, task_default, device, env, args)
    shutil.rmtree(work, ignore_errors=True)
    return 0


def beats(t, base) -> bool:
    """The server's milestone rule: more than 5% faster."""
    return t is not None and base is not None and base > 0 and (base - t) / base > 0.05


def reward(t, eager, compiled) -> float:
    if not beats(t, eager):
        return 1.0
    return 3.0 if beats(t, compiled) else 2.0


def before(skills: Path, cands: list, dirs: dict, task_default, device: str, env: dict, args) -> None:
    """The same candidates through an older single-process evaluate.py: its baseline run (eager
    and torch.compile, which the server cached per task) and its candidate run, each timed; the
    build is its own phase, timed apart. It shares the extension directory with the runs above,
    so a build that the older harness asks for with the same sources and flags is a cache hit:
    the table compares evaluations with the build excluded, and on a GPU host the six builds
    again would take most of a run's time limit."""
    old = str(skills / "evaluate.py")

    def run(argv):
        t0 = time.perf_counter()
        out = subprocess.run([sys.executable, old, *argv], capture_output=True, text=True, env=env)
        lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
        return (json.loads(lines[-1]) if lines else {"correct": False, "reason": out.stderr[-500:]}), time.perf_counter() - t0

    print(f"\nBefore: {skills}", flush=True)
    with concurrent.futures.ThreadPoolExecutor(max(1, args.parallel_builds)) as pool:
        builds = dict(zip(cands, pool.map(lambda c: run(["candidate", "--task", str(task_for(c, task_default)), "--candidate", str(dirs[c]),
                                                             "--device", device, "--phase", "build"])[1], cands)))
    rows = []
    for cand in cands:
        task = str(task_for(cand, task_default))
        build_s = builds[cand]
        base, base_s = run(["baseline", "--task", task, "--device", device] + (["--no-compile"] if args.no_compile else []))
        res, run_s = run(["candidate", "--task", task, "--candidate", str(dirs[cand]), "--device", device, "--phase", "run"])
        if res.get("correct"):
            e = (base.get("eager") or {}).get("median_ms")
            c = (base.get("compile") or {}).get("median_ms")
            t = res["candidate"]["median_ms"]
            rows.append([cand.stem, f"correct, reward {reward(t, e, c):.0f}", f"{e:.3f}" if e else "-", f"{c:.3f}" if c else "-", f"{t:.3f}",
                         f"{e / t:.2f}" if e else "-", f"{c / t:.2f}" if c else "-", f"{build_s:.1f}", f"{base_s:.1f}", f"{run_s:.1f}"])
        else:
            rows.append([cand.stem, (res.get("reason") or "?")[:60].replace("|", "/"), "-", "-", "-", "-", "-", f"{build_s:.1f}", f"{base_s:.1f}", f"{run_s:.1f}"])
        print("| " + " | ".join(rows[-1]) + " |", flush=True)
    print()
    print("| candidate | verdict | eager ms | compile ms | candidate ms | x eager | x compile | build s | baseline wall s | candidate wall s |")
    print("|" + " --- |" * 10)
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    sys.exit(main())
