"""Task synthesis: mine seed operators from PyTorch, compose 3-5 of them into fused tasks
(serial, parallel and residual patterns), render each as a KernelBench task file and keep
only those that pass the filters of the CUDA Agent recipe:

- runs in eager mode and under torch.compile (and both agree);
- deterministic (two runs give the same output);
- not constant in its inputs (different inputs give different outputs);
- eager runtime inside a window (default 1-100 ms on the target device).

Prints one JSON object per line (seeds, each candidate's verdict, done) for the caller's
progress bar; writes tasks to OUT/level2/ and the manifest to OUT/manifest.jsonl.

With --judge it composes nothing and runs no proposed code: it prints the seed operators,
then answers requests on stdin, one JSON object per line: {"op": "screen", "id", "source"}
(a static screen of imports, calls and attributes a task has no use for: a guard against a
model's mistakes, not a sandbox) with {"event": "screened", "id", "reason"}, and
{"op": "check", "id", "results"} with the verdict computed from a run's results file
({"event": "verdict", "id", "reason", "eager_ms"}). The caller runs each proposal with
--run DIR inside the sandbox (kernelbench/src/synth/worker.rs): the proposal's code runs
there and nowhere else, and what it prints or writes can only reject it.
"""

from __future__ import annotations

import argparse
import ast
import errno
import hashlib
import io
import os
import json
import random
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

warnings.filterwarnings("ignore")

# Shape families: (name, full-size shape, small shape). Ops are mined per family.
FAMILIES = {
    "vec": ((4096, 4096), (8, 64)),
    "img": ((16, 64, 64, 64), (2, 4, 8, 8)),
}

# Tensor methods that are not computations on the tensor's values (or change state).
SKIP_METHODS = {
    "backward", "cpu", "cuda", "to", "numpy", "tolist", "item", "clone", "contiguous", "detach",
    "requires_grad_", "retain_grad", "register_hook", "pin_memory", "share_memory_", "storage",
    "untyped_storage", "data_ptr", "element_size", "dim", "numel", "size", "stride", "type",
    "type_as", "view_as", "expand_as", "reshape_as", "new_empty", "new_zeros", "new_ones",
    "new_full", "new_tensor", "new_empty_strided", "bernoulli", "multinomial", "uniform_",
    "normal_", "random_", "exponential_", "geometric_", "cauchy_", "log_normal_", "rand_like",
    "randn_like", "dropout", "cpu", "double", "half", "bfloat16", "float", "int", "long",
    "short", "char", "byte", "bool", "cfloat", "cdouble", "coalesce", "to_dense", "to_sparse",
    "to_mkldnn", "is_floating_point", "is_complex", "nelement", "ndimension", "align_to",
    "rename", "refine_names", "apply_", "map_", "map2_", "record_stream", "zero_", "fill_",
    "t", "T", "mT", "H", "mH", "adjoint", "conj", "resolve_conj", "resolve_neg", "positive",
    "detach_", "set_", "squeeze", "unsqueeze", "flatten", "ravel", "view", "reshape",
    "unfold", "diag_embed", "nan_to_num", "fix", "__deepcopy__", "__reduce_ex__", "__setstate__",
}
F_SKIP = {"dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout", "rrelu",
          "gumbel_softmax", "threshold", "hardtanh", "softmin", "glu"}


class Seed:
    """One seed operator: how to render it and which family it applies to."""

    def __init__(self, name, family, expr, module=None):
        self.name, self.family, self.expr, self.module = name, family, expr, module

    def build(self):
        return eval(self.module, {"nn": nn, "torch": torch}) if self.module else None  # noqa: S307 - our own strings


def sample(family, small, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = FAMILIES[family][1 if small else 0]
    return torch.randn(*shape, generator=g).to(device)


def works(fn, x):
    """Output is a float tensor of x's shape that is not x itself."""
    try:
        with torch.no_grad():
            y = fn(x)
        return (type(y) is torch.Tensor and y.layout == torch.strided and y.shape == x.shape and y.dtype == x.dtype
                and y.data_ptr() != x.data_ptr() and bool(torch.isfinite(y).all()) and not torch.equal(y, x))
    except Exception:  # noqa: BLE001 - mining tries everything
        return False


def mine(device, small):
    """Seed operators found in torch itself: tensor methods, torch.nn.functional callables and
    nn modules, each tried on each shape family."""
    seeds = []
    for family in FAMILIES:
        x = sample(family, small, device)
        for name in sorted(dir(torch.Tensor)):
            if name.startswith("_") or name.endswith("_") or name in SKIP_METHODS:
                continue
            if works(lambda t, n=name: getattr(t, n)(), x):
                seeds.append(Seed(f"Tensor.{name}", family, f"{{x}}.{name}()"))
        for name in sorted(dir(F)):
            fn = getattr(F, name)
            if name.startswith("_") or not callable(fn) or name in F_SKIP:
                continue
            if works(lambda t, f=fn: f(t), x):
                seeds.append(Seed(f"F.{name}", family, f"F.{name}({{x}})"))
        for name in sorted(dir(torch.special)):
            fn = getattr(torch.special, name)
            if name.startswith("_") or not callable(fn):
                continue
            if works(lambda t, f=fn: f(t), x):
                seeds.append(Seed(f"torch.special.{name}", family, f"torch.special.{name}({{x}})"))
        # Operators that take a dimension, over each dimension that keeps the shape.
        for dim in (1, -1):
            for tmpl in ("F.softmax({{x}}, dim={d})", "F.log_softmax({{x}}, dim={d})", "F.normalize({{x}}, dim={d})",
                         "torch.cumsum({{x}}, dim={d})", "torch.cumprod(torch.tanh({{x}}), dim={d})",
                         "torch.logcumsumexp({{x}}, dim={d})", "({{x}} - {{x}}.mean(dim={d}, keepdim=True))"):
                expr = tmpl.format(d=dim)
                if works(lambda t, e=expr: eval(e.format(x="t"), {"torch": torch, "F": F, "t": t}), x):  # noqa: S307
                    seeds.append(Seed(expr.replace("{x}", "x"), family, expr))
        d = x.shape[1]
        modules = [
            f"nn.Linear({d}, {d})" if family == "vec" else None,
            f"nn.LayerNorm({x.shape[-1]})",
            f"nn.Conv2d({d}, {d}, 1)" if family == "img" else None,
            f"nn.Conv2d({d}, {d}, 3, padding=1)" if family == "img" else None,
            f"nn.Conv2d({d}, {d}, 5, padding=2)" if family == "img" else None,
            f"nn.Conv2d({d}, {d}, 3, padding=1, groups={d})" if family == "img" else None,
            f"nn.BatchNorm2d({d})" if family == "img" else f"nn.BatchNorm1d({d})",
            f"nn.GroupNorm(2, {d})",
            "nn.MaxPool2d(3, stride=1, padding=1)" if family == "img" else None,
            "nn.AvgPool2d(3, stride=1, padding=1)" if family == "img" else None,
            f"nn.InstanceNorm2d({d}, affine=True)" if family == "img" else None,
        ]
        for name in sorted(dir(nn)):
            cls = getattr(nn, name)
            if isinstance(cls, type) and issubclass(cls, nn.Module) and cls.__module__.endswith("activation"):
                modules.append(f"nn.{name}()")
        for spec in filter(None, modules):
            try:
                m = eval(spec, {"nn": nn}).to(device).eval()  # noqa: S307 - our own strings
            except Exception:  # noqa: BLE001
                continue
            if works(m, x):
                seeds.append(Seed(spec, family, "self.m{i}({x})", module=spec))
    return seeds


MERGES = ["{a} + {b}", "{a} * {b}", "torch.maximum({a}, {b})", "{a} - {b}"]


def compose(rng, seeds_by_family, small, plant=None):
    """A random composition: (family, pattern, ops, source)."""
    family = rng.choice(sorted(seeds_by_family))
    pool = seeds_by_family[family]
    n = rng.randint(3, 5)
    ops = [rng.choice(pool) for _ in range(n)]
    pattern = rng.choice(["serial", "parallel", "residual"])
    init, body = [], []
    counter = iter(range(100))

    def apply(op, var):
        i = next(counter)
        if op.module:
            init.append(f"        self.m{i} = {op.module}")
        return op.expr.format(x=var, i=i)

    if pattern == "serial":
        v = "x"
        for op in ops:
            body.append(f"        x = {apply(op, v)}")
    elif pattern == "parallel":
        cut = rng.randint(1, n - 1)
        a, b = "x", "x"
        for op in ops[:cut]:
            body.append(f"        a = {apply(op, a)}")
            a = "a"
        for op in ops[cut:]:
            body.append(f"        b = {apply(op, b)}")
            b = "b"
        body.append("        x = " + rng.choice(MERGES).format(a=a, b=b))
    else:
        v = "x"
        for op in ops[:-1]:
            body.append(f"        y = {apply(op, v)}")
            v = "y"
        body.append(f"        x = {apply(ops[-1], f'x + {v}')}")
    if plant == "nondeterministic":
        body.append("        x = x + torch.rand_like(x)")
        pattern, ops = "planted", ops
    elif plant == "constant":
        body.append("        x = x * 0.0 + 1.0")
        pattern = "planted"
    full, small_shape = FAMILIES[family]
    init_block = "\n".join(init) if init else "        pass"
    source = f'''import os

import torch
import torch.nn as nn
import torch.nn.functional as F

SMALL = os.environ.get("CUDA_AGENT_TASK_SIZE") == "small"
SHAPE = {small_shape} if SMALL else {full}


class Model(nn.Module):
    """Synthesized ({pattern}): {", ".join(o.name for o in ops)}."""

    def __init__(self):
        super().__init__()
{init_block}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
{chr(10).join(body)}
        return x


def get_inputs():
    return [torch.randn(*SHAPE)]


def get_init_inputs():
    return []


def get_inputs_alt():
    """A second shape: the batch dimension odd (no multiple of 4, 8 or 16) and about half."""
    return [torch.randn(SHAPE[0] // 2 | 1, *SHAPE[1:])]
'''.replace("        super().__init__()\n        pass\n", "        super().__init__()\n")
    return family, pattern, [o.name for o in ops], source


def load_source(source, name):
    ns = {}
    exec(compile(source, name, "exec"), ns)  # noqa: S102 - our own rendered tasks
    return ns


def time_ms(model, inputs, device, trials=5):
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()
    with torch.no_grad():
        model(*inputs)
        sync()
        ts = []
        for _ in range(trials):
            t = time.perf_counter()
            model(*inputs)
            sync()
            ts.append((time.perf_counter() - t) * 1e3)
    ts.sort()
    return ts[len(ts) // 2]


class Refused(Exception):
    """A candidate's run ended in a rejection; its argument is the reason."""


def refusal(stage, e):
    """The reason for an exception a candidate's run raised at `stage` (eager, alt_shape,
    compile): what the sandbox refused (a file, a socket, a process, memory) is named with
    its message, anything else by its type alone."""
    cause = e
    if isinstance(getattr(e, "reason", None), OSError):
        cause = e.reason  # urllib's URLError wraps the socket's error
    if isinstance(cause, OSError) and cause.errno in (errno.EACCES, errno.EPERM, errno.EAGAIN, errno.ENOMEM):
        return f"sandbox_denied: {type(cause).__name__}: {str(cause)[:160]}"
    # torch's file functions raise RuntimeError with the system's message inside.
    for denied in ("Permission denied", "Operation not permitted"):
        if denied in str(e):
            return f"sandbox_denied: {type(e).__name__}: {denied}: {str(e)[:120]}"
    if isinstance(e, MemoryError) or "can't allocate memory" in str(e) or "not enough memory" in str(e):
        return f"memory_limit: {type(e).__name__}: {str(e)[:160]}"
    return f"{stage}_error: {type(e).__name__}"


def run_candidate(source, device, small, args, timed=True):
    """Runs a candidate as the filters need it, in this process: its outputs on the five input
    sets (seeds 1-5, as the final evaluation), the first again, the second shape's output,
    torch.compile's output on the first set, and its eager time. Raises Refused.

    For a proposed source this runs in `--run` mode, inside the sandbox: its results are data
    for `check` in the filters' worker, never a verdict."""
    os.environ["CUDA_AGENT_TASK_SIZE"] = "small" if small else "full"
    try:
        ns = load_source(source, "candidate")
        torch.manual_seed(0)
        model = ns["Model"](*ns["get_init_inputs"]()).to(device).eval()
        xs = []
        for seed in range(1, 6):
            torch.manual_seed(seed)
            xs.append([t.to(device) for t in ns["get_inputs"]()])
        with torch.no_grad():
            ys = [model(*x) for x in xs]
            y1b = model(*xs[0])
    except Exception as e:  # noqa: BLE001
        raise Refused(refusal("eager", e)) from None
    try:  # the judge checks the second shape too: it must run and give another shape
        torch.manual_seed(6)
        with torch.no_grad():
            alt = model(*[t.to(device) for t in ns["get_inputs_alt"]()])
    except Exception as e:  # noqa: BLE001
        raise Refused(refusal("alt_shape", e)) from None
    try:
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=args.compile_backend)
        with torch.no_grad():
            yc = compiled(*xs[0])
    except Exception as e:  # noqa: BLE001
        raise Refused(refusal("compile", e)) from None
    if not timed:  # timed by the caller, from outside this process
        def run():
            with torch.no_grad():
                model(*xs[0])
            if device.type == "cuda":
                torch.cuda.synchronize()
        return {"ys": ys, "y1b": y1b, "alt": alt, "yc": yc, "run": run}
    try:
        ms = time_ms(model, xs[0], device)
    except Exception as e:  # noqa: BLE001
        raise Refused(refusal("eager", e)) from None
    return {"ys": ys, "y1b": y1b, "alt": alt, "yc": yc, "ms": float(ms)}


def check(res, args):
    """(None, eager ms) if a candidate's results pass every filter, else (the reason, None).
    Computed here from the results alone, whoever produced them."""
    tensors = [*res.get("ys", []), res.get("y1b"), res.get("alt"), res.get("yc")]
    if len(res.get("ys", [])) != 5 or not all(type(t) is torch.Tensor for t in tensors):
        return "malformed_results", None
    if not isinstance(res.get("ms"), float):
        return "malformed_results", None
    ys, y1b, alt, yc, ms = res["ys"], res["y1b"], res["alt"], res["yc"], res["ms"]
    if alt.shape == ys[0].shape or not bool(torch.isfinite(alt).all()):
        return "alt_shape", None
    y1, y2 = ys[0], ys[1]
    if not all(bool(torch.isfinite(y).all()) for y in ys):
        return "non_finite", None
    if y1.shape != y1b.shape or not torch.equal(y1, y1b):
        return "nondeterministic", None
    if y1.shape == y2.shape and torch.allclose(y1, y2):
        return "constant_output", None
    if y1.numel() == 0 or y1.abs().max() == 0:
        return "constant_output", None
    if yc.shape != y1.shape or not torch.allclose(yc, y1, atol=1e-3, rtol=1e-3):
        return "compile_mismatch", None
    if not (args.min_ms <= ms <= args.max_ms):
        return f"runtime_window: {ms:.3f} ms", None
    return None, ms


def verdict(source, device, small, args):
    """(None, eager ms) if our own composition passes every filter, else (the reason, None):
    the random synthesis runs and checks its own sources in one process."""
    try:
        res = run_candidate(source, device, small, args)
    except Refused as r:
        return r.args[0], None
    return check(res, args)


# The largest results file `check` reads: the outputs of small sizes are kilobytes; a full-size
# task's five outputs are at most a few hundred MB.
MAX_RESULTS_BYTES = 2 << 30


def send_frame(out, header, payload=b""):
    """One message of the run's inner protocol: a JSON header line, then `len` bytes."""
    out.write((json.dumps({**header, "len": len(payload)}) + "\n").encode() + payload)
    out.flush()


def read_frame(inp, limit):
    """(header, payload) of one message, or (None, b"") at the end or on a malformed one."""
    line = inp.readline(4096)
    try:
        header = json.loads(line)
        n = int(header.get("len", 0))
    except (ValueError, TypeError, AttributeError):
        return None, b""
    if not 0 <= n <= limit:
        return None, b""
    payload = inp.read(n)
    return (header, payload) if len(payload) == n else (None, b"")


def serve_candidate(scratch, device, small, args):
    """`--candidate DIR`: the proposal's own process (started by `run_proposal`, inside the
    sandbox). Sends its outputs, then runs the forward on request so that `run_proposal`
    can time it from outside."""
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    source = (Path(scratch) / "candidate.py").read_text()
    try:
        res = run_candidate(source, device, small, args, timed=False)
    except Refused as r:
        send_frame(replies, {"kind": "refused", "reason": r.args[0]})
        return 0
    buf = io.BytesIO()
    torch.save({k: ([t.detach().cpu() for t in v] if k == "ys" else v.detach().cpu()) for k, v in res.items()
                if k != "run"}, buf)
    send_frame(replies, {"kind": "results"}, buf.getvalue())
    for line in sys.stdin:
        if line.strip() != "time":
            break
        try:
            res["run"]()
        except Exception as e:  # noqa: BLE001
            send_frame(replies, {"kind": "refused", "reason": refusal("eager", e)})
            return 0
        send_frame(replies, {"kind": "done"})
    return 0


def others_alive():
    """Pids of this namespace's other processes of this uid (the proposal's leftovers)."""
    me, uid = os.getpid(), os.getuid()
    pids = []
    for d in os.listdir("/proc"):
        if d.isdigit() and int(d) != me:
            try:
                if os.stat(f"/proc/{d}").st_uid == uid:
                    pids.append(int(d))
            except OSError:
                pass
    return pids


def run_proposal(scratch, device, small, args):
    """`--run DIR`: our side of a proposal's run, inside the sandbox. The proposal runs in a
    child process (`--candidate`); this one receives its outputs, times its forward from
    outside (round trips on a pipe), makes sure nothing of it is left, and only then writes
    DIR/results.pt (or DIR/reason.txt). The proposal never holds the pen: results it wrote
    itself are overwritten, and a run it ended early or killed is rejected by its status.
    With --isolated (its own pid namespace and uid, which the caller checked), every other
    process of the uid is the proposal's, and is killed before the results are written."""
    scratch = Path(scratch)
    for name in ("results.pt", "reason.txt"):
        (scratch / name).unlink(missing_ok=True)
    cmd = [sys.executable, os.path.abspath(__file__), "--candidate", str(scratch), "--device", args.device,
           "--compile-backend", args.compile_backend] + (["--size", args.size] if args.size else [])
    child = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=scratch)

    def finish(reason=None, results=None):
        try:
            child.stdin.close()
        except OSError:
            pass
        try:
            status = child.wait(timeout=10)
        except subprocess.TimeoutExpired:
            child.kill()
            status = child.wait()
        if reason is None and status != 0:
            reason = f"worker_died: exit status: {status}" if status > 0 else f"worker_died: signal: {-status}"
        if reason is None and results is None:
            reason = "malformed_results: no results"
        if args.isolated:
            left = others_alive()
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            if left and reason is None:
                reason = f"left_processes: {len(left)} still running when the run ended"
        # A name the proposal may have made a link is replaced, not written through.
        tmp = scratch / f".{os.getpid()}.tmp"
        if reason is not None:
            tmp.write_text(reason)
            os.replace(tmp, scratch / "reason.txt")
        else:
            torch.save(results, tmp)
            os.replace(tmp, scratch / "results.pt")
        return 0

    header, payload = read_frame(child.stdout, MAX_RESULTS_BYTES)
    if header is None:
        return finish()  # its status says why (or, exited 0 without results: below)
    if header.get("kind") == "refused":
        return finish(str(header.get("reason", "eager_error: refused"))[:200])
    if header.get("kind") != "results":
        return finish("malformed_results")
    try:
        res = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001
        return finish(f"malformed_results: {type(e).__name__}")
    if not isinstance(res, dict):
        return finish("malformed_results")
    times = []
    for trial in range(6):
        t = time.perf_counter()
        try:
            child.stdin.write(b"time\n")
            child.stdin.flush()
        except OSError:
            return finish()
        header, _ = read_frame(child.stdout, 0)
        if header is None:
            return finish()
        if header.get("kind") != "done":
            return finish(str(header.get("reason", "eager_error: refused"))[:200])
        if trial:  # the first is a warm-up
            times.append((time.perf_counter() - t) * 1e3)
    times.sort()
    res["ms"] = times[len(times) // 2]
    return finish(None, res)


def check_results(path, args):
    """The verdict on a sandboxed run's results file (written by code we do not trust: read
    with torch's weights-only unpickler, bounded in size)."""
    path = Path(path)
    try:
        size = path.stat().st_size
    except OSError:
        return "malformed_results: no results", None
    if size > MAX_RESULTS_BYTES:
        return f"malformed_results: {size} bytes", None
    try:
        res = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001
        return f"malformed_results: {type(e).__name__}", None
    if not isinstance(res, dict):
        return "malformed_results", None
    return check(res, args)


# What a proposed task may import (top-level modules) and may not call or touch.
ALLOWED_IMPORTS = {"torch", "math", "os", "typing", "__future__", "functools", "operator", "numbers"}
FORBIDDEN_CALLS = {"eval", "exec", "compile", "open", "__import__", "input", "breakpoint", "globals", "locals",
                   "vars", "setattr", "delattr", "exit", "quit", "memoryview"}
ALLOWED_DUNDERS = {"__init__", "__name__", "__future__"}
REQUIRED_DEFS = ("get_inputs", "get_init_inputs", "get_inputs_alt")


def screen(source):
    """The reason a proposed source is refused before it runs, or None."""
    try:
        tree = ast.parse(source)
    except SyntaxError as e:
        return f"syntax_error: line {e.lineno}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or "."]
        else:
            names = []
        for n in names:
            if n.split(".")[0] not in ALLOWED_IMPORTS:
                return f"forbidden_import: {n}"
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in FORBIDDEN_CALLS:
            return f"forbidden_call: {node.func.id}"
        if isinstance(node, ast.Attribute):
            if node.attr.startswith("__") and node.attr not in ALLOWED_DUNDERS:
                return f"forbidden_attribute: {node.attr}"
            if isinstance(node.value, ast.Name) and node.value.id == "os" and node.attr != "environ":
                return f"forbidden_attribute: os.{node.attr}"
        if isinstance(node, ast.Name) and node.id.startswith("__") and node.id not in ALLOWED_DUNDERS:
            return f"forbidden_name: {node.id}"
    top = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    missing = [n for n in ("Model",) + REQUIRED_DEFS if n not in top]
    if missing:
        return "not_a_task: does not define " + ", ".join(missing)
    return None


def judge(args, device, small):
    """Verdicts on proposed sources read from stdin (see the module's docstring)."""
    # The protocol keeps the real stdout; what a candidate prints goes to stderr.
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def send(obj):
        proto.write(json.dumps(obj) + "\n")
        proto.flush()

    seeds = mine(device, small)
    # Python's prefixes: the sandbox must let each run read them.
    prefixes = sorted({sys.prefix, sys.base_prefix, os.path.dirname(os.path.dirname(os.path.realpath(sys.executable)))})
    send({"event": "seeds", "count": len(seeds), "ops": [{"name": s.name, "family": s.family} for s in seeds],
          "prefixes": prefixes})
    # No proposed code ever runs here: `screen` parses it, and `check` reads the results of its
    # run in the sandbox (`--run`), which the caller started.
    for line in sys.stdin:
        try:
            req = json.loads(line)
        except ValueError:
            continue
        if req.get("op") == "screen":
            send({"event": "screened", "id": req["id"], "reason": screen(req["source"])})
        elif req.get("op") == "check":
            reason, eager_ms = check_results(req["results"], args)
            send({"event": "verdict", "id": req["id"], "reason": reason, "eager_ms": eager_ms})


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--count", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", default=None)
    p.add_argument("--size", choices=["small", "full"], default=None, help="input sizes used by the filters (default: small on CPU)")
    p.add_argument("--min-ms", type=float, default=1.0)
    p.add_argument("--max-ms", type=float, default=100.0)
    p.add_argument("--compile-backend", default="inductor", help="torch.compile backend for the filter (inductor, or eager to only trace)")
    p.add_argument("--max-attempts", type=int, default=0, help="give up after this many candidates (default 20 x count)")
    p.add_argument("--plant-bad", action="store_true", help="also test a known non-deterministic and a constant composition")
    p.add_argument("--judge", action="store_true", help="screen proposed sources and check their runs' results (stdin)")
    p.add_argument("--run", metavar="DIR", help="run DIR/candidate.py for the filters (in the sandbox), write DIR/results.pt")
    p.add_argument("--candidate", metavar="DIR", help=argparse.SUPPRESS)  # --run's child: the proposal's process
    p.add_argument("--isolated", action="store_true", help="--run has a pid namespace and uid of its own")
    args = p.parse_args()
    device = torch.device(args.device)
    small = (args.size or ("small" if device.type == "cpu" else "full")) == "small"
    if args.candidate:
        return serve_candidate(args.candidate, device, small, args)
    if args.run:
        return run_proposal(args.run, device, small, args)
    if args.judge:
        return judge(args, device, small)
    if not args.out or args.count <= 0:
        p.error("--out and a positive --count are needed unless --judge")
    out = Path(args.out)
    (out / "level2").mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    seeds = mine(device, small)
    by_family = {}
    for s in seeds:
        by_family.setdefault(s.family, []).append(s)
    print(json.dumps({"event": "seeds", "count": len(seeds), "by_family": {k: len(v) for k, v in by_family.items()}}), flush=True)
    manifest = open(out / "manifest.jsonl", "a")
    seen = set()
    for line in (out / "manifest.jsonl").read_text().splitlines():
        try:
            seen.add(json.loads(line)["hash"])
        except (ValueError, KeyError):
            pass
    accepted = attempts = 0
    plants = ["nondeterministic", "constant"] if args.plant_bad else []
    max_attempts = args.max_attempts or 20 * args.count
    while accepted < args.count and attempts < max_attempts:
        attempts += 1
        plant = plants.pop(0) if plants else None
        family, pattern, ops, source = compose(rng, by_family, small, plant)
        digest = hashlib.sha256(source.encode()).hexdigest()
        if digest in seen:
            reason, eager_ms = "duplicate", None
        else:
            seen.add(digest)
            reason, eager_ms = verdict(source, device, small, args)
        shapes = {"full": list(FAMILIES[family][0]), "small": list(FAMILIES[family][1])}
        rec = {"event": "candidate", "hash": digest, "family": family, "shapes": shapes, "pattern": pattern, "ops": ops,
               "planted": plant, "verdict": "accepted" if reason is None else "rejected", "reason": reason}
        if reason is None:
            accepted += 1
            name = f"{accepted}_{pattern}_{digest[:10]}"
            path = out / "level2" / f"{name}.py"
            k = 1
            while path.exists():
                k += 1
                path = out / "level2" / f"{name}_{k}.py"
            path.write_text(source)
            rec["file"] = str(path.relative_to(out))
            rec["eager_ms"] = eager_ms
        if reason != "duplicate":
            manifest.write(json.dumps({k: v for k, v in rec.items() if k != "event"}) + "\n")
            manifest.flush()
        print(json.dumps(rec), flush=True)
    print(json.dumps({"event": "done", "accepted": accepted, "attempts": attempts}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
