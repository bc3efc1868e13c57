"""Eager (and optionally torch.compile) time of every bundled task, in one process, with the
harness's own timer: the check that the suite is sized as meant (full size: eager 1-100 ms on
the target GPU; small size, which the server picks on CPU machines: eager 1-10 ms on the CPU,
aiming at 1.5-4 ms so that timing noise stays well under the 5% step between rewards).

    python scripts/task_times.py [--size small|full] [--device cpu|cuda] [--compile] [--rounds 3]
                                 [--tasks-dir kernelbench/tasks] [--json FILE]
                                 [--only L1/30_GroupNorm,L2/17_Mul_Add_Sigmoid]

--size sets CUDA_AGENT_TASK_SIZE before the tasks are loaded (default: small on a CPU, full on
a GPU, as the server does). Each task is timed in --rounds rounds, round-robin over the suite,
so that a burst of load from other processes lands on one round of many tasks rather than on
every trial of one; the eager column is the median of the round medians, the spread is the
10th-90th percentile of all trials pooled, as a share of that median. Prints a Markdown table
and a summary of how many tasks fall inside [--min-ms, --max-ms] (default 1-10 ms on a CPU,
1-100 ms on a GPU).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
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


class Recorder:
    """Wraps a callable and keeps the time of each call, measured the harness's way (CPU:
    perf_counter around the call; CUDA: events around it, read once the harness has
    synchronized), so that percentiles can be taken of the very trials the harness timed."""

    def __init__(self, fn, device):
        self.fn, self.device, self.marks = fn, device, []

    def __call__(self, *args):
        if self.device.type == "cuda":
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            out = self.fn(*args)
            e.record()
            self.marks.append((s, e))
        else:
            t0 = time.perf_counter()
            out = self.fn(*args)
            self.marks.append((time.perf_counter() - t0) * 1e3)
        return out

    def last(self, n: int) -> list[float]:
        marks = self.marks[-n:]
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return [s.elapsed_time(e) for s, e in marks]
        return list(marks)


def timed(fn, inputs, device, budget_s: float) -> tuple[float, list[float]]:
    rec = Recorder(fn, device)
    res = h.time_callable(rec, inputs, device, budget_s=budget_s)
    return res["median_ms"], rec.last(res["trials"])


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--size", choices=["small", "full"], help="task size (default: small on a CPU, full on a GPU)")
    ap.add_argument("--tasks-dir", default=str(ROOT / "kernelbench" / "tasks"))
    ap.add_argument("--compile", action="store_true", help="also time torch.compile (slow: one compilation per task)")
    ap.add_argument("--budget-s", type=float, default=0.5, help="timing budget per callable and round")
    ap.add_argument("--rounds", type=int, default=3, help="timing rounds, round-robin over the tasks")
    ap.add_argument("--min-ms", type=float, default=1.0)
    ap.add_argument("--max-ms", type=float, help="upper end of the window (default: 10 on a CPU, 100 on a GPU)")
    ap.add_argument("--json", help="write the rows as JSON too")
    ap.add_argument("--only", help="comma-separated task ids to time (default: all)")
    args = ap.parse_args()
    device = h.pick_device(args.device)
    size = args.size or ("full" if device.type == "cuda" else "small")
    os.environ["CUDA_AGENT_TASK_SIZE"] = size  # read by the task modules when they are loaded
    max_ms = args.max_ms if args.max_ms is not None else (100.0 if device.type == "cuda" else 10.0)
    h.pin_precision()
    paths = sorted(Path(args.tasks_dir).glob("level*/*.py"), key=lambda p: (p.parent.name, int(p.stem.split("_")[0])))
    if args.only:
        wanted = set(args.only.split(","))
        paths = [p for p in paths if task_id(p) in wanted]

    rows = {task_id(p): {"task": task_id(p)} for p in paths}
    medians: dict[str, list[float]] = {k: [] for k in rows}
    trials: dict[str, list[float]] = {k: [] for k in rows}
    cmedians: dict[str, list[float]] = {k: [] for k in rows}
    compiled_models: dict[str, object] = {}
    for rnd in range(max(args.rounds, 1)):
        for path in paths:
            tid = task_id(path)
            row = rows[tid]
            if "error" in row:
                continue
            try:
                task = h.load_task(path)
                model, inputs = h.reference_and_inputs(task, device)
                row["shape"] = shape_of(inputs)
                med, ts = timed(model, inputs, device, args.budget_s)
                medians[tid].append(med)
                trials[tid] += ts
                if args.compile:
                    if tid not in compiled_models:
                        t0 = time.perf_counter()
                        compiled = torch.compile(model)
                        with torch.no_grad():
                            compiled(*inputs)
                        row["compile_s"] = time.perf_counter() - t0
                        compiled_models[tid] = compiled
                    cmedians[tid].append(timed(compiled_models[tid], inputs, device, args.budget_s)[0])
                del model, inputs
            except Exception as e:  # a broken task is a row of the table, not the end of the sweep
                row["error"] = f"{type(e).__name__}: {e}"[:200]
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        print(f"round {rnd + 1} of {args.rounds} done", file=sys.stderr, flush=True)

    print(f"| task | {size} shape | eager median ms | p10-p90 spread | compile median ms | in window |")
    print("| --- | --- | --- | --- | --- | --- |")
    for tid, row in rows.items():
        if "error" in row:
            print(f"| {tid} | {row.get('shape', '')} | error: {row['error']} | | | |")
            continue
        eager = statistics.median(medians[tid])
        row.update(eager_ms=eager, eager_rounds_ms=medians[tid], trials=len(trials[tid]),
                   p10_ms=percentile(trials[tid], 0.1), p90_ms=percentile(trials[tid], 0.9))
        row["spread"] = (row["p90_ms"] - row["p10_ms"]) / eager if eager > 0 else 0.0
        row["in_window"] = args.min_ms <= eager <= max_ms
        comp = "-"
        if cmedians[tid]:
            row["compile_ms"] = statistics.median(cmedians[tid])
            comp = f"{row['compile_ms']:.3f} (built in {row['compile_s']:.0f} s)"
        print(f"| {tid} | {row['shape']} | {eager:.3f} | {row['spread'] * 100:.1f}% | {comp} | {'yes' if row['in_window'] else 'no'} |")

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
        if hasattr(os, "getloadavg"):
            print(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.json:
        env = h.environment(device) | {"size": size, "rounds": args.rounds, "threads": torch.get_num_threads()}
        Path(args.json).write_text(json.dumps({"env": env, "rows": list(rows.values())}, indent=1))


if __name__ == "__main__":
    t0 = time.perf_counter()
    main()
    print(f"swept in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
