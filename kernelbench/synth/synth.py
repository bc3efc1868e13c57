"""Task synthesis: mine seed operators from PyTorch, compose 3-5 of them into fused tasks
(serial, parallel and residual patterns), render each as a KernelBench task file and keep
only those that pass the filters of the CUDA Agent recipe:

- runs in eager mode and under torch.compile (and both agree);
- deterministic (two runs give the same output);
- not constant in its inputs (different inputs give different outputs);
- eager runtime inside a window (default 1-100 ms on the target device).

Prints one JSON object per line (seeds, each candidate's verdict, done) for the caller's
progress bar; writes tasks to OUT/level2/ and the manifest to OUT/manifest.jsonl.

With --judge it composes nothing: it prints the seed operators, then reads task sources
proposed by a model (one JSON object per line on stdin: {"id", "source"}) and answers each
with its verdict ({"event": "verdict", "id", "reason", "eager_ms"}); the caller writes the
tasks. A proposed source is screened first (imports, calls and attributes a task has no use
for): a guard against a model's mistakes, not a sandbox.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import os
import json
import random
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


def verdict(source, device, small, args):
    """(None, eager ms) if the task passes every filter, else (the reason, None).

    It runs on five input sets, as the final evaluation does (seeds 1-5), so an operator that
    fails or overflows on some random inputs (a singular matrix for `cholesky_inverse`, say)
    is rejected here rather than breaking the evaluation of every candidate for the task."""
    import os
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
        return f"eager_error: {type(e).__name__}", None
    try:  # the judge checks the second shape too: it must run and give another shape
        torch.manual_seed(6)
        with torch.no_grad():
            alt = model(*[t.to(device) for t in ns["get_inputs_alt"]()])
        if alt.shape == ys[0].shape or not torch.isfinite(alt).all():
            return "alt_shape", None
    except Exception as e:  # noqa: BLE001
        return f"alt_shape_error: {type(e).__name__}", None
    y1, y2 = ys[0], ys[1]
    if not all(torch.isfinite(y).all() for y in ys):
        return "non_finite", None
    if not torch.equal(y1, y1b):
        return "nondeterministic", None
    if torch.allclose(y1, y2):
        return "constant_output", None
    if y1.abs().max() == 0:
        return "constant_output", None
    try:
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=args.compile_backend)
        with torch.no_grad():
            yc = compiled(*xs[0])
        if not torch.allclose(yc, y1, atol=1e-3, rtol=1e-3):
            return "compile_mismatch", None
    except Exception as e:  # noqa: BLE001
        return f"compile_error: {type(e).__name__}", None
    try:
        ms = time_ms(model, xs[0], device)
    except Exception as e:  # noqa: BLE001
        return f"eager_error: {type(e).__name__}", None
    if not (args.min_ms <= ms <= args.max_ms):
        return f"runtime_window: {ms:.3f} ms", None
    return None, ms


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
    send({"event": "seeds", "count": len(seeds), "ops": [{"name": s.name, "family": s.family} for s in seeds]})
    for line in sys.stdin:
        try:
            req = json.loads(line)
        except ValueError:
            continue
        reason, eager_ms = screen(req["source"]), None
        if reason is None:
            reason, eager_ms = verdict(req["source"], device, small, args)
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
    p.add_argument("--judge", action="store_true", help="judge proposed sources from stdin instead of composing")
    args = p.parse_args()
    device = torch.device(args.device)
    small = (args.size or ("small" if device.type == "cpu" else "full")) == "small"
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
