"""Checks model_new.py (ModelNew) against model.py (Model) in this workspace.

    python verify.py [--device auto|cpu|cuda] [--tolerance ATOL] [--trials 5]

Same init arguments and weights for both models, fresh random inputs for every trial (the
final evaluation uses other seeds you never see), outputs compared within the tolerance.
Prints a JSON result; exit code 0 when correct.
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
    p.add_argument("--device", default=os.environ.get("CUDA_AGENT_DEVICE", "auto"))
    p.add_argument("--tolerance", type=float, help="absolute and relative tolerance (default by dtype: 1e-4 float32, 1e-2 half)")
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--dir", default=".", help="workspace holding model.py and model_new.py")
    args = p.parse_args()
    here = Path(args.dir)
    device = h.pick_device(args.device)
    h.pin_precision()
    result: dict = {"correct": False}
    try:
        task = h.load_task(here / "model.py")
        counter = h.ExtensionCalls()
        cand = h.load_candidate(here, device, counter)
        seeds = [int.from_bytes(os.urandom(4), "little") for _ in range(args.trials)]
        errors = []
        for i, seed in enumerate(seeds):
            ref, new = h.make_models(task, cand, device, seed)
            inputs = h.seeded_inputs(task, seed + 1, device)
            with torch.no_grad():
                ref_out = ref(*h.clone_inputs(inputs))
            new_out = h.traced_forward(new, h.clone_inputs(inputs), counter, device, label=f"trial {i + 1}: ")
            try:
                errors.append(h.compare(ref_out, new_out, args.tolerance, args.tolerance))
            except h.RuleBreak as e:
                raise h.RuleBreak(e.rule, f"trial {i + 1}: {e}") from e
        result = {
            "correct": True,
            "trials": len(seeds),
            "max_abs_error": max(e["max_abs_error"] for e in errors),
            "max_rel_error": max(e["max_rel_error"] for e in errors),
        }
    except h.RuleBreak as e:
        result = {"correct": False, "rule": e.rule, "reason": str(e)}
    except Exception as e:  # noqa: BLE001
        result = {"correct": False, "rule": "error", "reason": f"{type(e).__name__}: {e}"}
    print(json.dumps(result, indent=2))
    print("PASS" if result["correct"] else f"FAIL: {result.get('reason')}", file=sys.stderr)
    return 0 if result["correct"] else 1


if __name__ == "__main__":
    sys.exit(main())
