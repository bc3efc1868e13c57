"""Eager (and optionally torch.compile) time of every bundled task, in one process, with the
harness's own timer: the check that the suite is sized as meant (eager 1-100 ms on the target
GPU at full size).

    python scripts/task_times.py --device cuda [--compile] [--tasks-dir kernelbench/tasks] [--json FILE]
                                 [--only L1/30_GroupNorm,L2/17_Mul_Add_Sigmoid]

Prints a Markdown table and a summary of how many tasks fall inside [--min-ms, --max-ms].
"""

from __future__ import annotations

import argparse
import gc
import json
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--tasks-dir", default=str(ROOT / "kernelbench" / "tasks"))
    ap.add_argument("--compile", action="store_true", help="also time torch.compile (slow: one compilation per task)")
    ap.add_argument("--budget-s", type=float, default=0.5, help="timing budget per callable")
    ap.add_argument("--min-ms", type=float, default=1.0)
    ap.add_argument("--max-ms", type=float, default=100.0)
    ap.add_argument("--json", help="write the rows as JSON too")
    ap.add_argument("--only", help="comma-separated task ids to time (default: all)")
    args = ap.parse_args()
    device = h.pick_device(args.device)
    h.pin_precision()
    paths = sorted(Path(args.tasks_dir).glob("level*/*.py"), key=lambda p: (p.parent.name, int(p.stem.split("_")[0])))
    if args.only:
        wanted = set(args.only.split(","))
        paths = [p for p in paths if task_id(p) in wanted]
    rows = []
    print("| task | eager ms | cv | compile ms | in window |")
    print("| --- | --- | --- | --- | --- |")
    for path in paths:
        row = {"task": task_id(path)}
        try:
            task = h.load_task(path)
            model, inputs = h.reference_and_inputs(task, device)
            eager = h.time_callable(model, inputs, device, budget_s=args.budget_s)
            row.update(eager_ms=eager["median_ms"], eager_cv=eager["cv"])
            if args.compile:
                compiled = torch.compile(model)
                with torch.no_grad():
                    compiled(*inputs)
                row["compile_ms"] = h.time_callable(compiled, inputs, device, budget_s=args.budget_s)["median_ms"]
            row["in_window"] = args.min_ms <= row["eager_ms"] <= args.max_ms
            del model, inputs
        except Exception as e:  # a broken task is a row of the table, not the end of the sweep
            row["error"] = f"{type(e).__name__}: {e}"[:200]
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        rows.append(row)
        if "error" in row:
            print(f"| {row['task']} | error: {row['error']} | | | |", flush=True)
        else:
            comp = f"{row['compile_ms']:.4f}" if "compile_ms" in row else "-"
            print(f"| {row['task']} | {row['eager_ms']:.4f} | {row['eager_cv'] * 100:.1f}% | {comp} | {'yes' if row['in_window'] else 'no'} |", flush=True)
    timed = [r for r in rows if "eager_ms" in r]
    inside = sum(r["in_window"] for r in timed)
    print()
    if timed:
        print(f"{len(rows)} tasks, {len(timed)} timed on {device} ({h.environment(device).get('gpu', 'CPU')}): "
              f"{inside} inside {args.min_ms:g}-{args.max_ms:g} ms; eager median of medians {statistics.median(r['eager_ms'] for r in timed):.3f} ms, "
              f"min {min(r['eager_ms'] for r in timed):.3f}, max {max(r['eager_ms'] for r in timed):.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"env": h.environment(device), "rows": rows}, indent=1))


if __name__ == "__main__":
    t0 = time.perf_counter()
    main()
    print(f"swept in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
