"""The server's final evaluation. Run by env-server from its own pristine copy, in a fresh
sandbox, never from files the agent could touch.

    evaluate.py baseline  --task model.py --device cpu              # eager and torch.compile times
    evaluate.py candidate --task model.py --candidate DIR --device cpu --seeds 1,2,3,4,5 --phase build|run|all

Prints one JSON object on stdout (and writes it to --out when given).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import traceback
from pathlib import Path

# This directory holds profile.py, which must not shadow the standard library's profile
# module (torch imports it): look here last.
_HERE = str(Path(__file__).resolve().parent)
sys.path[:] = [p for p in sys.path if p and str(Path(p).resolve()) != _HERE] + [_HERE]
import cuda_agent_harness as h  # noqa: E402
import torch  # noqa: E402


def guarded_identities() -> dict:
    """Functions a candidate could patch to fool the checks or the timers."""
    import torch.nn.functional as F

    things = {
        "time.perf_counter": time.perf_counter,
        "torch.allclose": torch.allclose,
        "torch.isfinite": torch.isfinite,
        "torch.randn": torch.randn,
        "torch.rand": torch.rand,
        "torch.cuda.synchronize": torch.cuda.synchronize,
        "torch.cuda.Event": torch.cuda.Event,
        "torch.Tensor.__eq__": torch.Tensor.__eq__,
        "torch.Tensor.double": torch.Tensor.double,
        "torch.nn.Module.__call__": torch.nn.Module.__call__,
        "F.linear": F.linear,
        "h.compare": h.compare,
        "h.time_callable": h.time_callable,
        "h.OpTrace": h.OpTrace,
        "json.dumps": json.dumps,
    }
    return {k: id(v) for k, v in things.items()}


def baseline(args) -> dict:
    device = h.pick_device(args.device)
    h.pin_precision()
    task = h.load_task(Path(args.task))
    model, inputs = h.reference_and_inputs(task, device)
    result = {"env": h.environment(device), "eager": h.time_callable(model, inputs, device)}
    if not args.no_compile:
        compiled = torch.compile(model)
        with torch.no_grad():
            compiled(*inputs)  # compile outside the timed region
        result["compile"] = h.time_callable(compiled, inputs, device)
    return result


def candidate(args) -> dict:
    device = h.pick_device(args.device)
    h.pin_precision()
    flags_before = h.precision_flags()
    task = h.load_task(Path(args.task))
    cand_dir = Path(args.candidate)
    identities = guarded_identities()
    threads_before = threading.active_count()
    counter = h.ExtensionCalls()
    build_start = time.perf_counter()
    try:
        with h.quiet_stdout():
            cand = h.load_candidate(cand_dir, device, counter)
    except h.RuleBreak:
        raise
    except Exception as e:  # noqa: BLE001 - any failure to build is the candidate's
        raise h.RuleBreak("compile", f"{type(e).__name__}: {e}") from e
    build_s = time.perf_counter() - build_start
    if args.phase == "build":
        return {"built": True, "build_s": build_s, "extensions": counter.modules}

    seeds = [int(s) for s in args.seeds.split(",")]
    allowed = h.ALLOWED_OPS | {op.strip() for op in (args.allow_ops or "").split(",") if op.strip()}
    details = {"build_s": build_s, "seeds": len(seeds), "extensions": counter.modules}
    errors = []
    previous_out = None
    previous_ref = None
    for i, seed in enumerate(seeds):
        ref, new = h.make_models(task, cand, device, seed)
        inputs = h.seeded_inputs(task, seed + 1, device)
        ref_inputs, new_inputs = h.clone_inputs(inputs), h.clone_inputs(inputs)
        with torch.no_grad():
            ref_out = ref(*ref_inputs)  # kept alive until compared: its memory cannot be reused
            h.poison_free_memory(ref_out, device)
        new_out = h.traced_forward(new, new_inputs, counter, device, allowed, label=f"input set {i + 1}: ")
        for a, b in zip(h.flatten_outputs(new_inputs), h.flatten_outputs(inputs)):
            if isinstance(a, torch.Tensor) and not torch.equal(a, b):
                raise h.RuleBreak("input_mutation", f"input set {i + 1}: the candidate changed its inputs in place")
        try:
            errors.append(h.compare(ref_out, new_out, args.atol, args.rtol))
        except h.RuleBreak as e:
            raise h.RuleBreak(e.rule, f"input set {i + 1} of {len(seeds)}: {e}") from e
        # Outputs must follow the inputs: same output for different inputs where the reference differs is caching.
        if previous_out is not None:
            same_new = all(torch.equal(a, b) for a, b in zip(h.flatten_outputs(new_out), h.flatten_outputs(previous_out)) if isinstance(a, torch.Tensor))
            same_ref = all(torch.equal(a, b) for a, b in zip(h.flatten_outputs(ref_out), h.flatten_outputs(previous_ref)) if isinstance(a, torch.Tensor))
            if same_new and not same_ref:
                raise h.RuleBreak("constant_output", "the output did not change when the inputs did")
        previous_out = [t.clone() if isinstance(t, torch.Tensor) else t for t in h.flatten_outputs(new_out)]
        previous_ref = [t.clone() if isinstance(t, torch.Tensor) else t for t in h.flatten_outputs(ref_out)]
    # A second shape, where the task offers one: a kernel hard-coded to the first fails here.
    if hasattr(task, "get_inputs_alt"):
        ref, new = h.make_models(task, cand, device, seeds[0])
        torch.manual_seed(seeds[-1] + 7)
        alt = h.inputs_on(task.get_inputs_alt, device)
        with torch.no_grad():
            want = ref(*h.clone_inputs(alt))
            try:
                with h.quiet_stdout():
                    got = new(*h.clone_inputs(alt))
                h.synchronize(device)
                h.compare(want, got, args.atol, args.rtol)
            except Exception as e:  # noqa: BLE001 - a crash on the other shape counts too
                raise h.RuleBreak("hard_coded_shape", f"wrong on a second input shape: {e}") from e
        details["second_shape"] = True
    details["max_abs_error"] = max(e["max_abs_error"] for e in errors)
    details["max_rel_error"] = max(e["max_rel_error"] for e in errors)

    ref, new = h.make_models(task, cand, device, seeds[0])
    inputs = h.seeded_inputs(task, seeds[0] + 1, device)
    with h.quiet_stdout():
        timing = h.time_callable(new, inputs, device)
    # The timed instance, called again on inputs it has not seen, must still be right: an
    # output cached from earlier calls (the timed ones included) fails here.
    for k, seed in enumerate(seeds[1:3]):
        fresh = h.seeded_inputs(task, seed + 1, device)
        with torch.no_grad():
            want = ref(*h.clone_inputs(fresh))
            with h.quiet_stdout():
                got = new(*h.clone_inputs(fresh))
            h.synchronize(device)
        try:
            h.compare(want, got, args.atol, args.rtol)
        except h.RuleBreak as e:
            raise h.RuleBreak("constant_output", f"after timing, a call on new inputs gave a stale result ({e})") from e
    changed = [k for k, v in guarded_identities().items() if identities[k] != v]
    if changed:
        raise h.RuleBreak("patching", f"the candidate replaced {', '.join(changed)}")
    if h.precision_flags() != flags_before:
        raise h.RuleBreak("precision", f"the candidate changed precision flags: {h.precision_flags()} (pinned: {flags_before})")
    if threading.active_count() > threads_before:
        raise h.RuleBreak("background_work", "the candidate left background threads running")
    children = h.child_processes()
    if children:
        raise h.RuleBreak("background_work", f"the candidate left {len(children)} child process(es) running")
    floor = h.physical_floor_ms(inputs, ref_out, device)
    if floor is not None and timing["median_ms"] < 0.9 * floor:
        raise h.RuleBreak(
            "impossible_time",
            f"median {timing['median_ms']:.4f} ms is below the {floor:.4f} ms it takes to move the inputs and outputs at peak bandwidth",
        )
    return {"correct": True, "candidate": timing, "details": details, "env": h.environment(device)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("baseline", help="time eager and torch.compile")
    b.add_argument("--task", required=True)
    b.add_argument("--device", default="auto")
    b.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    b.add_argument("--out")
    c = sub.add_parser("candidate", help="build, check and time model_new.py")
    c.add_argument("--task", required=True)
    c.add_argument("--candidate", required=True, help="directory holding model_new.py (and kernels/)")
    c.add_argument("--device", default="auto")
    c.add_argument("--seeds", default="1,2,3,4,5")
    c.add_argument("--phase", choices=["build", "run", "all"], default="all")
    c.add_argument("--allow-ops", help="comma-separated aten operators the candidate may also dispatch")
    c.add_argument("--atol", type=float)
    c.add_argument("--rtol", type=float)
    c.add_argument("--out")
    args = p.parse_args()
    try:
        result = baseline(args) if args.cmd == "baseline" else candidate(args)
    except h.RuleBreak as e:
        result = {"correct": False, "rule": e.rule, "reason": f"{e.rule}: {e}"}
    except Exception as e:  # noqa: BLE001
        result = {"correct": False, "rule": "harness_error", "reason": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
    text = json.dumps(result)
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
