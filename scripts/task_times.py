"""Eager (and optionally torch.compile) time of every bundled task, each in a fresh process as
an evaluation is, timed the way the harness times them: the check that the suite is sized as meant (full size: eager 1-100 ms on
the target GPU; small size, which the server picks on CPU machines: eager 1-10 ms on the CPU,
aiming at 1.5-4 ms so that timing noise stays well under the 5% step between rewards).

    python scripts/task_times.py [--size small|full] [--device cpu|cuda] [--compile] [--rounds 3]
                                 [--tasks-dir kernelbench/tasks] [--json FILE]
                                 [--only L1/30_GroupNorm,L2/17_Mul_Add_Sigmoid]

--size sets CUDA_AGENT_TASK_SIZE before the tasks are loaded (default: small on a CPU, full on
a GPU, as the server does). Each task is timed in --rounds rounds, round-robin over the suite,
so that a burst of load from other processes lands on one round of many tasks rather than on
every trial of one; the eager column is the median of the round medians, the spread is the
10th-90th percentile of all trials pooled, as a share of that median; the fastest trial is
what the task costs when nothing else runs (on a loaded CPU the medians are not). Prints a Markdown table
and a summary of how many tasks fall inside [--min-ms, --max-ms] (default 1-10 ms on a CPU,
1-100 ms on a GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT / "skills"))
import cuda_agent_harness as h  # noqa: E402
import torch  # noqa: E402


def task_id(path: Path) -> str:
    return f"L{path.parent.name.removeprefix('level')}/{path.stem}"


def shape_of(inputs) -> str:
    return ", ".join("x".join(map(str, t.shape)) if isinstance(t, torch.Tensor) else repr(t) for t in inputs)


def reference_and_inputs(task, device, seed: int = 0):
    """The reference model built under `seed` and one input set from the same seed, created on
    the device: what the harness times eager and torch.compile on."""
    torch.manual_seed(seed)
    model = task.Model(*task.get_init_inputs()).to(device).eval()
    torch.manual_seed(seed)
    with torch.device(device):
        inputs = list(task.get_inputs())
    return model, [x.to(device) if isinstance(x, torch.Tensor) else x for x in inputs]


def timed(fn, inputs, device, budget_s: float, min_trials=10, max_trials=100, warmup=3, warmup_s=0.25) -> list[float]:
    """Every trial's time in ms, taken the way the harness's timer takes them: one untimed call,
    a warm-up of `warmup` calls (and `warmup_s` seconds on CUDA), then budget_s / (one call)
    trials clamped to [min_trials, max_trials]; CPU: perf_counter around each call; CUDA: events
    around each call, with the L2 cache flushed and the device synchronized between trials."""
    cuda = device.type == "cuda"
    flush = None
    if cuda:
        l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 64 << 20)
        flush = torch.empty(max(2 * l2, 64 << 20) // 4, dtype=torch.float32, device=device)

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    with torch.no_grad():
        fn(*inputs)
        sync()
        warm_start, calls = time.perf_counter(), 1
        while calls < warmup or (cuda and time.perf_counter() - warm_start < warmup_s):
            if flush is not None:
                flush.zero_()
            fn(*inputs)
            sync()
            calls += 1
        start = time.perf_counter()
        fn(*inputs)
        sync()
        one = max(time.perf_counter() - start, 1e-6)
        times = []
        for _ in range(int(min(max_trials, max(min_trials, budget_s / one)))):
            if flush is not None:
                flush.zero_()
            sync()
            if cuda:
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                fn(*inputs)
                e.record()
                torch.cuda.synchronize(device)
                times.append(s.elapsed_time(e))
            else:
                t0 = time.perf_counter()
                fn(*inputs)
                times.append((time.perf_counter() - t0) * 1e3)
    return times


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def measure(path: Path, device, budget_s: float, compile_too: bool) -> dict:
    """One task timed in this process: its input shapes, every eager trial, and optionally the
    time torch.compile took to build and every compiled trial."""
    out: dict = {}
    try:
        task = h.load_task(path)
        model, inputs = reference_and_inputs(task, device)
        out["shape"] = shape_of(inputs)
        out["trials"] = timed(model, inputs, device, budget_s)
        if compile_too:
            t0 = time.perf_counter()
            compiled = torch.compile(model)
            with torch.no_grad():
                compiled(*inputs)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            out["compile_s"] = time.perf_counter() - t0
            out["compile_trials"] = timed(compiled, inputs, device, budget_s)
    except Exception as e:  # a broken task is a row of the table, not the end of the sweep
        out["error"] = f"{type(e).__name__}: {e}"[:200]
    out["load"] = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return out


def in_fresh_process(path: Path, args, size: str) -> dict:
    """measure() in a new Python process, as each evaluation runs: the allocator's state (glibc
    raises its mmap threshold after the first large free, and trims the heap by it) and the
    compile caches of one task must not leak into the next task's times."""
    cmd = [sys.executable, __file__, "--worker", str(path), "--device", args.device, "--size", size,
           "--budget-s", str(args.budget_s)] + (["--compile"] if args.compile else [])
    proc = subprocess.run(cmd, capture_output=True, text=True)
    lines = proc.stdout.strip().splitlines()
    try:
        return json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        return {"error": f"worker exited {proc.returncode}: {proc.stderr.strip()[-200:]}"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--size", choices=["small", "full"], help="task size (default: small on a CPU, full on a GPU)")
    ap.add_argument("--tasks-dir", default=str(ROOT / "kernelbench" / "tasks"))
    ap.add_argument("--compile", action="store_true", help="also time torch.compile (slow: one compilation per task and round)")
    ap.add_argument("--budget-s", type=float, default=0.5, help="timing budget per callable and round")
    ap.add_argument("--rounds", type=int, default=3, help="timing rounds, round-robin over the tasks, each task in a fresh process")
    ap.add_argument("--min-ms", type=float, default=1.0)
    ap.add_argument("--max-ms", type=float, help="upper end of the window (default: 10 on a CPU, 100 on a GPU)")
    ap.add_argument("--json", help="write the rows as JSON too")
    ap.add_argument("--only", help="comma-separated task ids to time (default: all)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)  # one task in this process; prints one JSON line
    args = ap.parse_args()
    device = h.pick_device(args.device)
    size = args.size or ("full" if device.type == "cuda" else "small")
    os.environ["CUDA_AGENT_TASK_SIZE"] = size  # read by the task modules when they are loaded
    h.pin_precision()
    if args.worker:
        print(json.dumps(measure(Path(args.worker), device, args.budget_s, args.compile)))
        return
    max_ms = args.max_ms if args.max_ms is not None else (100.0 if device.type == "cuda" else 10.0)
    paths = sorted(Path(args.tasks_dir).glob("level*/*.py"), key=lambda p: (p.parent.name, int(p.stem.split("_")[0])))
    if args.only:
        wanted = set(args.only.split(","))
        paths = [p for p in paths if task_id(p) in wanted]

    rows = {task_id(p): {"task": task_id(p)} for p in paths}
    runs: dict[str, list[dict]] = {k: [] for k in rows}
    load_start = os.getloadavg() if hasattr(os, "getloadavg") else None
    for rnd in range(max(args.rounds, 1)):
        for path in paths:
            tid = task_id(path)
            if "error" not in rows[tid]:
                r = in_fresh_process(path, args, size)
                rows[tid].update({k: r[k] for k in ("shape", "error") if k in r})
                runs[tid].append(r)
        print(f"round {rnd + 1} of {args.rounds} done", file=sys.stderr, flush=True)

    print(f"| task | {size} shape | eager median ms | p10-p90 spread | fastest ms | compile median ms | in window |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for tid, row in rows.items():
        if "error" in row:
            print(f"| {tid} | {row.get('shape', '')} | error: {row['error']} | | | | |")
            continue
        medians = [statistics.median(r["trials"]) for r in runs[tid]]
        trials = [t for r in runs[tid] for t in r["trials"]]
        eager = statistics.median(medians)
        row.update(eager_ms=eager, eager_rounds_ms=medians, trials=len(trials),
                   p10_ms=percentile(trials, 0.1), p90_ms=percentile(trials, 0.9), min_ms=min(trials),
                   load=[r["load"] for r in runs[tid]])
        row["spread"] = (row["p90_ms"] - row["p10_ms"]) / eager if eager > 0 else 0.0
        row["in_window"] = args.min_ms <= eager <= max_ms
        comp = "-"
        if args.compile:
            row["compile_ms"] = statistics.median(statistics.median(r["compile_trials"]) for r in runs[tid])
            row["compile_s"] = [r["compile_s"] for r in runs[tid]]
            comp = f"{row['compile_ms']:.3f} (built in {row['compile_s'][0]:.0f} s)"
        print(f"| {tid} | {row['shape']} | {eager:.3f} | {row['spread'] * 100:.1f}% | {row['min_ms']:.3f} | {comp} | {'yes' if row['in_window'] else 'no'} |")

    timed_rows = [r for r in rows.values() if "eager_ms" in r]
    print()
    if timed_rows:
        inside = sum(r["in_window"] for r in timed_rows)
        eagers = [r["eager_ms"] for r in timed_rows]
        where = h.environment(device).get("gpu", f"CPU, {torch.get_num_threads()} threads")
        print(f"{len(rows)} tasks ({size} size), {len(timed_rows)} timed on {device} ({where}), {args.rounds} rounds: "
              f"{inside} inside {args.min_ms:g}-{max_ms:g} ms; eager median of medians {statistics.median(eagers):.3f} ms, "
              f"min {min(eagers):.3f}, max {max(eagers):.3f}; median p10-p90 spread "
              f"{statistics.median(r['spread'] for r in timed_rows) * 100:.1f}%")
        loads = [x for r in timed_rows for x in r["load"] if x is not None]
        if loads:
            print(f"1-minute load average while timing: {min(loads):.2f}-{max(loads):.2f} (median {statistics.median(loads):.2f})")
    if args.json:
        env = h.environment(device) | {"size": size, "rounds": args.rounds, "threads": torch.get_num_threads(), "load_start": load_start}
        Path(args.json).write_text(json.dumps({"env": env, "rows": list(rows.values())}, indent=1))


if __name__ == "__main__":
    t0 = time.perf_counter()
    main()
    print(f"swept in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
