"""The server's final evaluation: the judge. Run by env-server from its own pristine copy, in a
sandbox of its own, never from files the agent could touch.

    evaluate.py candidate --task model.py --candidate DIR --device cpu [--seeds 1,2,3,4,5]
    evaluate.py candidate ... --worker-req FIFO --worker-rep FIFO --worker-pid PID
                              --worker-uid UID --worker-out DIR --inputs-dir DIR --workdir DIR

Without --worker-*, the judge starts the candidate worker itself (tests, local use). With them,
it talks to a worker the server started under another uid. Either way the judge never imports
candidate code. With --gate, it starts its side and waits for a line on stdin before any device
work or candidate code (the server starts the next evaluation while the device still times the
last one). Prints one JSON object on stdout (and writes it to --out when given).
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path

# This directory holds profile.py, which must not shadow the standard library's profile
# module (torch imports it): look here last.
_HERE = str(Path(__file__).resolve().parent)
sys.path[:] = [p for p in sys.path if p and str(Path(p).resolve()) != _HERE] + [_HERE]
import cuda_agent_harness as h  # noqa: E402
import cuda_agent_judge as judge  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("candidate", help="check and time model_new.py against eager and torch.compile")
    c.add_argument("--task", required=True)
    c.add_argument("--candidate", required=True, help="directory holding model_new.py (and kernels/)")
    c.add_argument("--device", default="auto")
    c.add_argument("--size", choices=["small", "full"],
                   help="the task's input size (CUDA_AGENT_TASK_SIZE; default: that variable where it is set, as the server sets it, else small on CPU and full on CUDA, as the server picks)")
    c.add_argument("--seeds", help="comma-separated model seeds of the checked input sets (default: 5 random)")
    c.add_argument("--allow-ops", help="comma-separated aten operators the candidate may also dispatch")
    c.add_argument("--atol", type=float)
    c.add_argument("--rtol", type=float)
    c.add_argument("--no-compile", action="store_true", help="do not time torch.compile")
    c.add_argument("--no-time", action="store_true", help="check only")
    c.add_argument("--budget-s", type=float, default=2.0, help="timing budget per contestant")
    c.add_argument("--setup-timeout", type=float, default=600.0)
    c.add_argument("--call-timeout", type=float, default=120.0)
    c.add_argument("--worker-req")
    c.add_argument("--worker-rep")
    c.add_argument("--worker-pid", type=int)
    c.add_argument("--worker-uid", type=int)
    c.add_argument("--worker-out")
    c.add_argument("--inputs-dir", help="where the candidate's input files go (readable by its uid)")
    c.add_argument("--workdir", help="the judge's private directory")
    c.add_argument("--out")
    c.add_argument("--gate", action="store_true",
                   help="start the workers, then wait for a line on stdin before anything runs on the device or any candidate code runs (the server's device lease)")
    args = p.parse_args()
    # The workers import the task too: they inherit the size through the environment. A task
    # at its full size on the CPU is gigabytes of inputs per call.
    if args.size:
        os.environ["CUDA_AGENT_TASK_SIZE"] = args.size
    elif "CUDA_AGENT_TASK_SIZE" not in os.environ:
        device = args.device
        if device == "auto":
            device = "cuda" if h.torch.cuda.is_available() else "cpu"
        os.environ["CUDA_AGENT_TASK_SIZE"] = "small" if device == "cpu" else "full"
    opts = judge.Options(device=args.device, atol=args.atol, rtol=args.rtol, compile=not args.no_compile, time=not args.no_time,
                         budget_s=args.budget_s, setup_timeout=args.setup_timeout, call_timeout=args.call_timeout, allow_ops=args.allow_ops)
    if args.seeds:
        opts.seeds = [int(s) for s in args.seeds.split(",")]
    attach = None
    if args.worker_req:
        def attach():
            link = judge.attach_worker(args.worker_req, args.worker_rep, args.worker_pid, args.worker_uid, Path(args.worker_out), opts.setup_timeout)
            return link, Path(args.inputs_dir)
    gate = judge.wait_for_go if args.gate else None
    try:
        result = judge.evaluate(Path(args.task), Path(args.candidate), opts, attach=attach, workdir=Path(args.workdir) if args.workdir else None, gate=gate)
    except Exception as e:  # noqa: BLE001 - the judge's own failure, never the candidate's verdict
        tb = traceback.format_exc()
        result = {"correct": False, "rule": "harness_error", "reason": f"harness_error: {type(e).__name__}: {e}\n{tb[-1500:]}", "traceback": tb[-4000:]}
    text = judge.verdict_json(result)
    if args.out:
        Path(args.out).write_text(text)
    sys.stdout.write(text + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    h.exit_now(main())
