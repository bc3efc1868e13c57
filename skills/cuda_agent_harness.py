"""Shared pieces of the cuda-agent evaluation harness: loading a task and a candidate,
building the candidate's kernels, comparing outputs, tracing the operators the candidate
dispatches and timing.

verify.py and profile.py (the agent's tools) and evaluate.py (the server's final evaluation)
are thin front ends over this module.
"""

from __future__ import annotations

import contextlib
import cProfile  # noqa: F401 - cache the standard library's profile modules before any
import profile  # noqa: F401   candidate directory (which may hold profile.py) joins sys.path
import hashlib
import importlib.util
import math
import os
import statistics
import sys
import time
import types
from pathlib import Path

import torch

# Precision flags are pinned so that eager, compile and the candidate are compared alike.
PINNED_FLAGS = {"allow_tf32_matmul": False, "allow_tf32_cudnn": False, "float32_matmul_precision": "highest"}

# Default tolerances by output dtype: (atol, rtol).
TOLERANCE = {
    torch.float32: (1e-4, 1e-4),
    torch.float64: (1e-6, 1e-6),
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (1e-2, 1e-2),
}

# Operators the candidate may dispatch: allocation, views, copies and metadata. Anything
# else computes, and computing must happen in the candidate's own kernels.
ALLOWED_OPS = {
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "zeros", "zeros_like",
    "new_zeros", "ones", "ones_like", "full", "full_like", "new_full", "fill_", "zero_",
    "view", "_unsafe_view", "reshape", "as_strided", "permute", "transpose", "t", "expand",
    "unsqueeze", "squeeze", "slice", "select", "alias", "detach", "flatten", "unflatten",
    "contiguous", "clone", "copy_", "_to_copy", "to", "lift_fresh", "split", "chunk",
    "narrow", "unbind", "view_as", "expand_as", "resize_", "set_", "sym_size", "sym_stride",
    "sym_numel", "sym_storage_offset", "is_contiguous", "dim", "size", "stride", "numel",
    "record_stream", "_local_scalar_dense", "item",
}


class RuleBreak(Exception):
    """The candidate broke an evaluation rule; `rule` names it."""

    def __init__(self, rule: str, message: str):
        super().__init__(message)
        self.rule = rule


def pin_precision() -> dict:
    torch.backends.cuda.matmul.allow_tf32 = PINNED_FLAGS["allow_tf32_matmul"]
    torch.backends.cudnn.allow_tf32 = PINNED_FLAGS["allow_tf32_cudnn"]
    torch.set_float32_matmul_precision(PINNED_FLAGS["float32_matmul_precision"])
    return dict(PINNED_FLAGS)


def precision_flags() -> dict:
    """The precision settings in force, to detect a candidate changing them."""
    return {
        "allow_tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        "allow_tf32_cudnn": torch.backends.cudnn.allow_tf32,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "allow_fp16_reduced_precision_reduction": torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction,
        "allow_bf16_reduced_precision_reduction": torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
    }


def poison_free_memory(outputs, device) -> None:
    """Fills memory the allocator will hand out next with NaN, so an output the candidate
    allocates but never writes cannot pass by holding stale correct values."""
    nbytes = sum(t.numel() * t.element_size() for t in flatten_outputs(outputs) if isinstance(t, torch.Tensor))
    for _ in range(2):
        junk = torch.full((max(nbytes // 4, 1) * 2,), float("nan"), dtype=torch.float32, device=device)
        del junk


def child_processes() -> list[int]:
    """Live child processes of this process (a candidate must leave none)."""
    kids = []
    task_dir = Path(f"/proc/{os.getpid()}/task")
    for t in task_dir.iterdir() if task_dir.is_dir() else []:
        try:
            kids += [int(p) for p in (t / "children").read_text().split()]
        except OSError:
            continue
    alive = []
    for pid in kids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z":
            alive.append(pid)
    return alive


# Peak DRAM bandwidth by device name, bytes/s, for the physical-floor check.
PEAK_BANDWIDTH = {"H200": 4.8e12, "H100 80GB HBM3": 3.35e12, "H100 PCIe": 2.0e12, "A100-SXM4-80GB": 2.04e12, "A100-SXM4-40GB": 1.56e12}


def physical_floor_ms(inputs, outputs, device):
    """The least time any kernel needs to read the inputs and write the outputs once."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    bw = next((v for k, v in PEAK_BANDWIDTH.items() if k in name), None)
    if bw is None:
        return None
    nbytes = sum(t.numel() * t.element_size() for t in flatten_outputs(inputs) + flatten_outputs(outputs) if isinstance(t, torch.Tensor))
    return nbytes / bw * 1e3


def pick_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda asked for, but torch sees no CUDA device")
    return torch.device(name)


def load_module(path: Path, name: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, str(path))
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def load_task(path: Path) -> types.ModuleType:
    task = load_module(path, "reference_task")
    for piece in ("Model", "get_inputs", "get_init_inputs"):
        if not hasattr(task, piece):
            raise ImportError(f"{path} does not define {piece}")
    return task


class ExtensionCalls:
    """Counts calls into compiled extension modules, so the harness knows a custom kernel ran."""

    def __init__(self):
        self.count = 0
        self.modules: list[str] = []

    def wrap(self, module):
        if module is None or isinstance(module, CountingModule):
            return module
        self.modules.append(getattr(module, "__name__", "extension"))
        return CountingModule(module, self)


class CountingModule:
    def __init__(self, module, counter: ExtensionCalls):
        object.__setattr__(self, "_module", module)
        object.__setattr__(self, "_counter", counter)

    def __getattr__(self, name):
        attr = getattr(self._module, name)
        if callable(attr) and not isinstance(attr, type):
            counter = self._counter

            def counted(*args, **kwargs):
                counter.count += 1
                return attr(*args, **kwargs)

            return counted
        return attr


def install_extension_counter(counter: ExtensionCalls) -> None:
    """Wraps torch.utils.cpp_extension.load/load_inline so every module they return counts calls."""
    import torch.utils.cpp_extension as cpp

    if getattr(cpp, "_cuda_agent_wrapped", False):
        return
    original_load, original_inline = cpp.load, cpp.load_inline

    def load(*args, **kwargs):
        return counter.wrap(original_load(*args, **kwargs))

    def load_inline(*args, **kwargs):
        return counter.wrap(original_inline(*args, **kwargs))

    cpp.load, cpp.load_inline = load, load_inline
    cpp._cuda_agent_wrapped = True


def build_kernels_dir(candidate_dir: Path, device: torch.device, counter: ExtensionCalls):
    """Compiles kernels/*.cpp and kernels/*.cu into one extension, importable as `kernels_ext`."""
    kdir = candidate_dir / "kernels"
    sources = sorted(p for p in kdir.glob("*") if p.suffix in (".cpp", ".cc", ".cu")) if kdir.is_dir() else []
    if not sources:
        return None
    has_cuda = any(p.suffix == ".cu" for p in sources)
    if has_cuda and device.type != "cuda":
        raise RuleBreak("compile", "kernels/ holds .cu files but the evaluation device is CPU")
    import torch.utils.cpp_extension as cpp

    digest = hashlib.sha256(b"".join(p.name.encode() + p.read_bytes() for p in sources)).hexdigest()[:16]
    name = f"kernels_ext_{digest}"
    # Build from copies at a stable path inside the extension's build directory, so that a
    # cached build of the same sources is up to date for ninja wherever the candidate lives.
    src_dir = Path(cpp._get_build_directory(name, verbose=False)) / "src"
    src_dir.mkdir(exist_ok=True)
    for p in sorted(kdir.iterdir()):
        if p.is_file():  # sources and headers alike
            dest = src_dir / p.name
            data = p.read_bytes()
            if not dest.exists() or dest.read_bytes() != data:
                dest.write_bytes(data)
    stable = [str(src_dir / p.name) for p in sources]
    module = cpp.load(
        name=name,
        sources=stable,
        extra_cflags=["-O3"],
        extra_cuda_cflags=["-O3"] if has_cuda else None,
        extra_include_paths=[str(src_dir)],
        with_cuda=has_cuda,
        verbose=False,
    )
    sys.modules["kernels_ext"] = module
    return module


def load_candidate(candidate_dir: Path, device: torch.device, counter: ExtensionCalls) -> types.ModuleType:
    install_extension_counter(counter)
    build_kernels_dir(candidate_dir, device, counter)
    sys.path.insert(0, str(candidate_dir))  # model_new.py may import its own helpers
    path = candidate_dir / "model_new.py"
    if not path.exists():
        raise RuleBreak("missing_solution", "model_new.py was not written")
    module = load_module(path, "model_new")
    if not hasattr(module, "ModelNew"):
        raise RuleBreak("missing_solution", "model_new.py does not define ModelNew")
    return module


def to_device(x, device):
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, (list, tuple)):
        return type(x)(to_device(v, device) for v in x)
    return x


def clone_inputs(x):
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, (list, tuple)):
        return type(x)(clone_inputs(v) for v in x)
    return x


def inputs_on(make, device):
    """`make()`'s inputs, created on `device` itself. Full-size tasks take gigabytes per
    tensor; made on the host first they would need that much host memory again (the
    sandbox's data limit refuses it) and a slow copy."""
    with torch.device(device):
        return to_device(list(make()), device)


def seeded_inputs(task, seed: int, device):
    torch.manual_seed(seed)
    return inputs_on(task.get_inputs, device)


def reference_and_inputs(task, device, seed: int = 0):
    """The reference model built under `seed` and one input set from the same seed: what
    eager and torch.compile are timed on."""
    torch.manual_seed(seed)
    model = task.Model(*task.get_init_inputs()).to(device).eval()
    return model, seeded_inputs(task, seed, device)


def make_models(task, candidate, device, seed: int):
    init = task.get_init_inputs()
    torch.manual_seed(seed)
    ref = task.Model(*init).to(device).eval()
    torch.manual_seed(seed)
    new = candidate.ModelNew(*init).to(device).eval()
    # Same weights: load the reference's parameters wherever names and shapes match.
    ref_state = ref.state_dict()
    new_state = new.state_dict()
    matched = {k: v for k, v in ref_state.items() if k in new_state and new_state[k].shape == v.shape}
    if matched:
        new.load_state_dict(matched, strict=False)
    return ref, new


def flatten_outputs(out) -> list:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in flatten_outputs(o)]
    return [out]


def compare(ref_out, new_out, atol=None, rtol=None) -> dict:
    """Compares outputs; raises RuleBreak('wrong_output', ...) with the first difference."""
    refs, news = flatten_outputs(ref_out), flatten_outputs(new_out)
    if len(refs) != len(news):
        raise RuleBreak("wrong_output", f"expected {len(refs)} outputs, got {len(news)}")
    max_abs = max_rel = 0.0
    for i, (r, n) in enumerate(zip(refs, news)):
        if not isinstance(r, torch.Tensor):
            if r != n:
                raise RuleBreak("wrong_output", f"output {i}: expected {r!r}, got {n!r}")
            continue
        if not isinstance(n, torch.Tensor):
            raise RuleBreak("wrong_output", f"output {i}: expected a tensor, got {type(n).__name__}")
        if type(n) is not torch.Tensor and not isinstance(n, torch.nn.Parameter):
            raise RuleBreak("tensor_subclass", f"output {i} is a {type(n).__name__}, not a plain tensor")
        if n.shape != r.shape:
            raise RuleBreak("wrong_output", f"output {i}: shape {tuple(n.shape)} != expected {tuple(r.shape)}")
        if n.dtype != r.dtype:
            raise RuleBreak("precision", f"output {i}: dtype {n.dtype} != expected {r.dtype}")
        if n.device != r.device:
            raise RuleBreak("wrong_output", f"output {i}: device {n.device} != expected {r.device}")
        if r.is_floating_point() and not torch.isfinite(n).all() and torch.isfinite(r).all():
            raise RuleBreak("wrong_output", f"output {i} holds NaN or Inf")
        a, rt = TOLERANCE.get(r.dtype, (1e-4, 1e-4))
        a = atol if atol is not None else a
        rt = rtol if rtol is not None else rt
        if r.numel() == 0:
            continue
        diff = (n.double() - r.double()).abs()
        abs_err = float(diff.max())
        rel_err = float((diff / r.double().abs().clamp_min(1e-12)).max())
        max_abs, max_rel = max(max_abs, abs_err), max(max_rel, min(rel_err, 1e30))
        if not torch.allclose(n.double(), r.double(), atol=a, rtol=rt, equal_nan=True):
            raise RuleBreak(
                "wrong_output",
                f"output {i}: max abs error {abs_err:.3g}, max rel error {rel_err:.3g} (atol {a}, rtol {rt})",
            )
    return {"max_abs_error": max_abs, "max_rel_error": max_rel}


class OpTrace:
    """Records every aten operator dispatched while active (from Python or from C++)."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        trace = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                trace.ops.append(func.overloadpacket.__name__)
                return func(*args, **(kwargs or {}))

        self.ops: list[str] = []
        self._mode = Mode()

    def __enter__(self):
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self._mode.__exit__(*exc)

    def forbidden(self, allowed=ALLOWED_OPS) -> list[str]:
        seen = []
        for op in self.ops:
            name = op.rstrip("_") if op not in allowed else op
            if op not in allowed and name not in allowed and op not in seen:
                seen.append(op)
        return seen


def traced_forward(model, inputs, counter: ExtensionCalls, device, allowed=ALLOWED_OPS, label=""):
    """Runs the candidate's forward under the operator trace and checks rules 1 and 2: no
    PyTorch compute operators dispatched, at least one compiled extension function called."""
    before = counter.count
    trace = OpTrace()
    try:
        with torch.no_grad(), quiet_stdout(), trace:
            out = model(*inputs)
        synchronize(device)
    except Exception as e:  # noqa: BLE001 - any crash is the candidate's
        raise RuleBreak("runtime_error", f"{label}{type(e).__name__}: {e}") from e
    bad = trace.forbidden(allowed)
    if bad:
        raise RuleBreak("pytorch_compute", f"the forward dispatched PyTorch compute operators: {', '.join(bad[:8])}")
    if counter.count == before:
        raise RuleBreak("no_custom_kernel", "no compiled extension function was called in the forward")
    return out


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class L2Flusher:
    """Writes a buffer larger than the L2 cache between trials, so no trial runs warm."""

    def __init__(self, device):
        self.buf = None
        if device.type == "cuda":
            l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 64 << 20)
            self.buf = torch.empty(max(2 * l2, 64 << 20) // 4, dtype=torch.float32, device=device)

    def __call__(self):
        if self.buf is not None:
            self.buf.zero_()


def time_callable(fn, inputs, device, min_trials=10, max_trials=100, budget_s=2.0, warmup=3, warmup_s=0.25) -> dict:
    """Median of many trials. CUDA: events with a full device synchronize around each trial,
    so work on side streams is counted; L2 flushed between trials. CPU: perf_counter.

    The warm-up runs at least `warmup` calls and, on CUDA, `warmup_s` seconds: a GPU that was
    idle needs a moment to reach its working clocks, and a few calls of a sub-millisecond
    kernel are over before it has."""
    flush = L2Flusher(device)
    with torch.no_grad():
        fn(*inputs)  # the first call may compile or autotune: not part of the warm-up's clock
        synchronize(device)
        warm_for = warmup_s if device.type == "cuda" else 0.0
        warm_start, calls = time.perf_counter(), 1
        while calls < warmup or time.perf_counter() - warm_start < warm_for:
            flush()
            fn(*inputs)
            synchronize(device)
            calls += 1
        start = time.perf_counter()
        fn(*inputs)
        synchronize(device)
        one = max(time.perf_counter() - start, 1e-6)
        trials = int(min(max_trials, max(min_trials, budget_s / one)))
        times = []
        for _ in range(trials):
            flush()
            synchronize(device)
            if device.type == "cuda":
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                fn(*inputs)
                e.record()
                torch.cuda.synchronize(device)
                times.append(s.elapsed_time(e))
            else:
                t0 = time.perf_counter()
                fn(*inputs)
                times.append((time.perf_counter() - t0) * 1e3)
    med = statistics.median(times)
    return {
        "median_ms": med,
        "mean_ms": statistics.fmean(times),
        "stdev_ms": statistics.stdev(times) if len(times) > 1 else 0.0,
        "min_ms": min(times),
        "max_ms": max(times),
        "cv": (statistics.stdev(times) / statistics.fmean(times)) if len(times) > 1 and statistics.fmean(times) > 0 else 0.0,
        "trials": len(times),
        "warmup_calls": calls,
    }


def environment(device) -> dict:
    env = {"torch": torch.__version__, "device": str(device), "python": sys.version.split()[0], "flags": dict(PINNED_FLAGS)}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
    return env


@contextlib.contextmanager
def quiet_stdout():
    """Keeps the candidate's prints out of the JSON answer on stdout."""
    saved = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(devnull)
        os.close(saved)


def geometric_mean(xs):
    xs = [x for x in xs if x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")
