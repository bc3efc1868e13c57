"""Times your ModelNew against the reference, eager and torch.compile, with the final
evaluation's judge.

    python profile.py --compare eager compile      # a table: eager, compile, candidate, speedups
    python profile.py --compare eager              # skip torch.compile (faster)
    python profile.py --json                       # the whole verdict as JSON on stdout
    python profile.py --only eager --torch-profile # top operators of the reference (where time goes)

ModelNew runs in its own worker process; the three contestants are called in random order in
each round, every round on fresh inputs, and every timed call's output is checked against
eager's. A time is the judge's clock from request to reply (the worker synchronizes the device
before replying). Medians, spread and a 90% noise band on each speedup, and what they mean for
the reward by its own rule. A line per step while it runs; the whole verdict, as JSON, goes to
profile_result.json (--result to put it elsewhere).
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
import torch  # noqa: E402


def torch_profile(here: Path, device) -> None:
    task = h.load_task(here / "model.py")
    torch.manual_seed(0)
    model = task.Model(*task.get_init_inputs()).to(device).eval()
    inputs = h.seeded_inputs(task.get_inputs, 0, device)
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch.no_grad():
        model(*inputs)
        with torch.profiler.profile(activities=acts) as prof:
            model(*inputs)
            h.synchronize(device)
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print("--- eager: top operators ---\n" + prof.key_averages().table(sort_by=key, row_limit=12))


def main() -> int:
    # Progress lines reach the agent as they are printed, even through a pipe.
    sys.stdout.reconfigure(line_buffering=True)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--compare", nargs="*", default=["eager", "compile"], choices=["eager", "compile"], help="baselines to time beside the candidate (eager is always timed)")
    p.add_argument("--only", choices=["eager"], help="with --torch-profile: profile the reference alone")
    p.add_argument("--device", default=os.environ.get("CUDA_AGENT_DEVICE", "auto"))
    p.add_argument("--budget-s", type=float, default=2.0, help="timing budget per contestant")
    p.add_argument("--json", action="store_true")
    p.add_argument("--torch-profile", action="store_true", help="print the reference's top operators by self time")
    p.add_argument("--dir", default=".")
    p.add_argument("--result", default="profile_result.json", help="where the full verdict goes, as JSON (relative to --dir)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.add_argument("--heartbeat-s", type=float, default=30.0, help="say a step still runs after this many silent seconds (0: never)")
    args = p.parse_args()
    here = Path(args.dir).resolve()
    device = h.pick_device(args.device)
    if args.torch_profile:
        torch_profile(here, device)
        if args.only:
            return 0
    opts = judge.Options(device=args.device, compile="compile" in (args.compare or []), budget_s=args.budget_s, seeds=[int.from_bytes(os.urandom(4), "little")])
    # Progress lines go to stderr under --json, so that stdout stays one JSON document.
    out = sys.stderr if args.json else sys.stdout
    progress = None if args.quiet else h.Progress(out, args.heartbeat_s)
    try:
        result = judge.evaluate(here / "model.py", here, opts, progress=progress)
    finally:
        if progress is not None:
            progress.close()
    try:
        (here / args.result).write_text(json.dumps(result, indent=2) + "\n")
        written = f"full verdict (JSON: every round's statistics, memory, the build): {args.result}"
    except OSError as e:
        written = f"full verdict not written to {args.result}: {e}"
    if args.json:
        print(json.dumps(result, indent=2))
        return 0 if result["correct"] else 1
    if not result["correct"]:
        print(f"candidate: {result['reason']}")
        print(written)
        return 1
    env = result["env"]
    print(f"device: {env['device']}  torch {env['torch']}")
    print(f"{'':<10}{'median ms':>12}{'p25 ms':>10}{'p75 ms':>10}{'cv':>8}{'trials':>8}")
    for name in ("eager", "compile", "candidate"):
        s = result["timing"].get(name)
        if s:
            print(f"{name:<10}{s['median_ms']:>12.4f}{s['p25_ms']:>10.4f}{s['p75_ms']:>10.4f}{s['cv']:>8.3f}{s['trials']:>8}")
    t = result["times_ms"]
    for base, s in result["speedup"].items():
        lo, hi = result["noise_band"][base]
        print(f"speedup vs {base}: {s:.3f}x (90% band {lo:.3f}-{hi:.3f}): {judge.milestone_note(t['candidate'], t[base], (lo, hi))}")
    reward = judge.milestone(True, t.get("candidate"), t.get("eager"), t.get("compile"))
    skipped = " (torch.compile not timed: run --compare eager compile for 3)" if t.get("compile") is None and reward == 2 else ""
    print(f"reward by the final evaluation's rule, were it to measure these medians: {reward}{skipped}")
    print(f"the rule: {judge.milestone_rule()}")
    print(written)
    return 0


if __name__ == "__main__":
    h.exit_now(main())
