"""Times the reference (eager and torch.compile) and your ModelNew.

    python profile.py --compare eager compile      # a table: eager, compile, candidate, speedups
    python profile.py --json                       # the same as JSON
    python profile.py --only eager --torch-profile # top operators of the reference (where time goes)

Median of many trials after warm-up; on CUDA, events with a full device synchronize around each
trial and L2 flushed between trials; precision flags pinned (TF32 off).
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
import torch  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--compare", nargs="*", default=["eager", "compile"], choices=["eager", "compile"], help="baselines to time beside the candidate")
    p.add_argument("--only", choices=["eager", "compile", "candidate"], help="time just one")
    p.add_argument("--device", default=os.environ.get("CUDA_AGENT_DEVICE", "auto"))
    p.add_argument("--json", action="store_true")
    p.add_argument("--torch-profile", action="store_true", help="print the top operators by self time")
    p.add_argument("--dir", default=".")
    args = p.parse_args()
    here = Path(args.dir)
    device = h.pick_device(args.device)
    h.pin_precision()
    task = h.load_task(here / "model.py")
    ref, inputs = h.reference_and_inputs(task, device)
    which = [args.only] if args.only else list(args.compare) + ["candidate"]
    results: dict = {"env": h.environment(device)}
    for name in which:
        if name == "eager":
            fn = ref
        elif name == "compile":
            fn = torch.compile(ref)
            with torch.no_grad():
                fn(*inputs)
        else:
            counter = h.ExtensionCalls()
            try:
                cand = h.load_candidate(here, device, counter)
                _, fn = h.make_models(task, cand, device, 0)
            except Exception as e:  # noqa: BLE001
                results["candidate"] = {"error": f"{type(e).__name__}: {e}"}
                continue
        results[name] = h.time_callable(fn, inputs, device)
        if args.torch_profile:
            acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
            with torch.profiler.profile(activities=acts) as prof, torch.no_grad():
                fn(*inputs)
                h.synchronize(device)
            key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
            print(f"--- {name}: top operators ---\n" + prof.key_averages().table(sort_by=key, row_limit=12), file=sys.stderr)
    cand = results.get("candidate", {})
    if "median_ms" in cand:
        for base in ("eager", "compile"):
            if base in results:
                results[f"speedup_vs_{base}"] = results[base]["median_ms"] / cand["median_ms"]
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    print(f"device: {results['env']['device']}  torch {results['env']['torch']}")
    print(f"{'':<10}{'median ms':>12}{'min ms':>10}{'cv':>8}{'trials':>8}")
    for name in ("eager", "compile", "candidate"):
        r = results.get(name)
        if r and "median_ms" in r:
            print(f"{name:<10}{r['median_ms']:>12.4f}{r['min_ms']:>10.4f}{r['cv']:>8.3f}{r['trials']:>8}")
        elif r:
            print(f"{name:<10}  {r['error']}")
    for base in ("eager", "compile"):
        if f"speedup_vs_{base}" in results:
            s = results[f"speedup_vs_{base}"]
            print(f"speedup vs {base}: {s:.3f}x {'(>5% faster: milestone reached)' if s > 1 / 0.95 else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
