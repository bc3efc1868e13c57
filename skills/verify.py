"""Checks model_new.py (ModelNew) against model.py (Model) in this workspace.

    python verify.py [--device auto|cpu|cuda] [--tolerance ATOL] [--trials 5]

The same judge as the final evaluation: ModelNew runs in a separate worker process, the
reference in another; same init arguments and weights, fresh random inputs for every trial
(the final evaluation uses other seeds you never see), outputs compared within the tolerance,
and the task's second input shape where it defines one. Prints a JSON result, then PASS or
FAIL with the reason; exit code 0 when correct. Add --time for the timed phase too (what profile.py prints, with every timed call
checked).
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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default=os.environ.get("CUDA_AGENT_DEVICE", "auto"))
    p.add_argument("--tolerance", type=float, help="absolute and relative tolerance (default by dtype: 1e-4 float32, 1e-2 half)")
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--time", action="store_true", help="also run the timed phase")
    p.add_argument("--dir", default=".", help="workspace holding model.py and model_new.py")
    args = p.parse_args()
    here = Path(args.dir).resolve()
    opts = judge.Options(device=args.device, atol=args.tolerance, rtol=args.tolerance, time=args.time,
                         seeds=[int.from_bytes(os.urandom(4), "little") for _ in range(max(1, args.trials))])
    result = judge.evaluate(here / "model.py", here, opts)
    # The reason is printed once, as it is (compiler output and tracebacks stay readable),
    # not a second time escaped inside the JSON.
    reason = result.pop("reason", None)
    print(json.dumps(result, indent=2))
    print("PASS" if result["correct"] else f"FAIL: {reason}")
    return 0 if result["correct"] else 1


if __name__ == "__main__":
    h.exit_now(main())
