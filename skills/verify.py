"""Checks model_new.py (ModelNew) against model.py (Model) in this workspace.

    python verify.py [--device auto|cpu|cuda] [--tolerance ATOL] [--trials 5] [--time]

The same judge as the final evaluation: ModelNew runs in a separate worker process, the
reference in another; same init arguments and weights, fresh random inputs for every trial
(the final evaluation uses other seeds you never see), outputs compared within the tolerance,
one input set off the task's distribution, and the task's second input shape where it defines
one. Prints a line per step while it runs, then a short summary: PASS or FAIL with the reason,
the errors and the tolerance that applied, the times. The whole verdict, as JSON, goes to
verify_result.json (--result to put it elsewhere). Exit code 0 when correct. Add --time for
the timed phase too (what profile.py prints, with every timed call checked).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

# This directory holds profile.py, which must not shadow the standard library's profile
# module (torch imports it): look here last.
_HERE = str(Path(__file__).resolve().parent)
sys.path[:] = [p for p in sys.path if p and str(Path(p).resolve()) != _HERE] + [_HERE]
import cuda_agent_harness as h  # noqa: E402
import cuda_agent_judge as judge  # noqa: E402


def tolerance_lines(details: dict) -> list[str]:
    """What a passing check's errors mean: the rule each output was checked by and the
    smallest difference it allowed anywhere, and why max_rel_error may exceed the tolerance."""
    out = []
    bounds = details.get("tolerance") or []
    for b in bounds:
        floor = b["typical_magnitude"]
        allowed = b["atol"] + b["rtol"] * floor
        out.append(
            f"  output {b['output']} ({b['dtype']}): passes where |got - want| <= atol {b['atol']:g} + rtol {b['rtol']:g} * max(|want|, {floor:.3g}),"
            f" {floor:.3g} being the output's typical |want| (90th percentile): every element may differ by {allowed:.3g}"
        )
    rel = details.get("max_rel_error")
    if bounds and isinstance(rel, (int, float)) and rel > max(b["rtol"] for b in bounds):
        out.append(
            f"  max_rel_error {rel:.3g} is |got - want| / |want| at its worst element, an output near zero: the bound there is the typical"
            " magnitude's, not the element's own, so it passed"
        )
    return out


def summary(result: dict, reason: str | None, result_path: str) -> list[str]:
    """The human summary of a verdict: a handful of lines, the details left to the JSON file."""
    d = result.get("details") or {}
    lines = []
    if result["correct"]:
        checked = [f"{d.get('checks', 0)} input sets"]
        off = d.get("off_distribution")
        checked.append("an input set off the task's distribution" if off == "checked" else f"the off-distribution set {off}" if off else None)
        checked.append("the second input shape" if d.get("second_shape") else "no second shape (model.py defines no get_inputs_alt)")
        lines.append("PASS: ModelNew matches Model on " + ", ".join(c for c in checked if c))
        lines.append(f"  errors: max abs {d.get('max_abs_error', 0):.3g}, max rel {d.get('max_rel_error', 0):.3g}")
        lines.extend(tolerance_lines(d))
    else:
        # The reason starts with the rule's name.
        lines.append(f"FAIL: {reason}")
    times = []
    stages = d.get("stage_s") or {}
    build = d.get("build_s") if isinstance(d.get("build_s"), (int, float)) else None
    start = stages.get("start") if isinstance(stages.get("start"), (int, float)) else None
    # The judge's start stage runs from the workers' launch through the build and import.
    if start is not None:
        times.append(f"workers' start (importing torch) {start - (build or 0.0):.1f} s")
    if build is not None:
        times.append(f"build and import of model_new.py {build:.1f} s")
    for name, label in (("check", "checks"), ("second_shape", "second shape"), ("time", "timing")):
        if isinstance(stages.get(name), (int, float)):
            times.append(f"{label} {stages[name]:.1f} s")
    if times:
        lines.append("  times: " + ", ".join(times))
    if result.get("times_ms"):
        t = result["times_ms"]
        lines.append("  medians: " + ", ".join(f"{n} {t[n]:.4g} ms" for n in ("eager", "compile", "candidate") if t.get(n) is not None))
        for base, s in (result.get("speedup") or {}).items():
            lo, hi = result["noise_band"][base]
            lines.append(f"  speedup vs {base}: {s:.3f}x (90% band {lo:.3f}-{hi:.3f}): {judge.milestone_note(t['candidate'], t[base], (lo, hi))}")
    lines.append(f"full verdict (JSON: every check, timing, memory, the build): {result_path}")
    return lines


def main() -> int:
    # Progress lines reach the agent as they are printed, even through a pipe.
    sys.stdout.reconfigure(line_buffering=True)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default=os.environ.get("CUDA_AGENT_DEVICE", "auto"))
    p.add_argument("--tolerance", type=float, help="absolute and relative tolerance (default by dtype: 1e-4 float32, 1e-2 half)")
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--time", action="store_true", help="also run the timed phase")
    p.add_argument("--dir", default=".", help="workspace holding model.py and model_new.py")
    p.add_argument("--result", default="verify_result.json", help="where the full verdict goes, as JSON (relative to --dir)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.add_argument("--heartbeat-s", type=float, default=30.0, help="say a step still runs after this many silent seconds (0: never)")
    args = p.parse_args()
    here = Path(args.dir).resolve()
    opts = judge.Options(device=args.device, atol=args.tolerance, rtol=args.tolerance, time=args.time,
                         seeds=[int.from_bytes(os.urandom(4), "little") for _ in range(max(1, args.trials))])
    progress = None if args.quiet else h.Progress(sys.stdout, args.heartbeat_s)
    try:
        result = judge.evaluate(here / "model.py", here, opts, progress=progress)
    finally:
        if progress is not None:
            progress.close()
    # The reason is printed once, as it is (compiler output and tracebacks stay readable),
    # not a second time escaped inside the JSON.
    reason = result.get("reason")
    path = here / args.result
    try:
        path.write_text(json.dumps(result, indent=2) + "\n")
        shown = args.result
    except OSError as e:
        shown = f"(not written: {e})"
    print("\n".join(summary(result, reason, shown)))
    return 0 if result["correct"] else 1


if __name__ == "__main__":
    h.exit_now(main())
