"""A worker of the evaluation: builds and runs one kind of model, on the judge's request.

    cuda_agent_worker.py build --task model.py --candidate DIR --device cpu
    cuda_agent_worker.py serve --role candidate|reference --task model.py [--candidate DIR]
                               --device cpu (--fds R,W | --req FIFO --rep FIFO) --out-dir DIR

`build` compiles the candidate's extensions and prints one JSON line (the server uses it to
report a compile error early; it decides nothing else). `serve` answers the judge's messages on
the channel (cuda_agent_harness.Channel): the candidate worker runs ModelNew, the reference
worker runs Model eagerly and under torch.compile.

A candidate worker runs hostile code in its own process: everything it reports is advisory.
Its failures count against it; its successes are checked by the judge on data the worker
cannot reach. See docs/EVALUATION.md.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import faulthandler
import fcntl
import functools
import gc
import hashlib
import json
import os
import re
import sys
import time
import traceback
from pathlib import Path

# This directory holds profile.py, which must not shadow the standard library's profile
# module (torch imports it): look here last.
_HERE = str(Path(__file__).resolve().parent)
sys.path[:] = [p for p in sys.path if p and str(Path(p).resolve()) != _HERE] + [_HERE]
import cProfile  # noqa: E402,F401 - cache the standard library's profile modules before any
import profile  # noqa: E402,F401    candidate directory (which may hold profile.py) joins sys.path

import cuda_agent_harness as h  # noqa: E402
import torch  # noqa: E402

# Taken before any candidate code runs: a later rebinding of torch.cuda.synchronize does not
# reach the worker's own barrier.
_cuda_sync = getattr(torch._C, "_cuda_synchronize", None)

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


class ExtensionCalls:
    """Counts calls into compiled extension modules, so the worker knows a custom kernel ran."""

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


_HELD_BUILD_LOCKS: set = set()


@contextlib.contextmanager
def build_lock(name, build_directory=None):
    """Holds an exclusive flock on an extension's build directory while it builds, and clears
    the `lock` file that torch's own build leaves behind when it is killed midway (a command
    that ran out of time): torch waits for that file to go, so every later build of the same
    name would hang. The flock dies with its process; a `lock` file found while holding it
    belongs to no live build that came through here. Re-entrant within a process; where the
    directory cannot be written (a finished build opened read-only), nothing is held."""
    import torch.utils.cpp_extension as cpp

    fd = key = bdir = None
    if isinstance(name, str) and name:
        try:
            bdir = Path(build_directory) if build_directory else Path(cpp._get_build_directory(name, verbose=False))
            key = str(bdir.resolve())
            if key not in _HELD_BUILD_LOCKS:
                fd = os.open(bdir / ".build-lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError:
            fd = None
    if fd is None:
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        _HELD_BUILD_LOCKS.add(key)
        with contextlib.suppress(OSError):
            (bdir / "lock").unlink()
        yield
    finally:
        _HELD_BUILD_LOCKS.discard(key)
        os.close(fd)


def install_extension_counter(counter: ExtensionCalls) -> None:
    """Wraps torch.utils.cpp_extension.load/load_inline so every module they return counts calls."""
    import torch.utils.cpp_extension as cpp

    if getattr(cpp, "_cuda_agent_wrapped", False):
        return
    original_load, original_inline = cpp.load, cpp.load_inline

    def load(*args, **kwargs):
        with build_lock(kwargs.get("name", args[0] if args else None), kwargs.get("build_directory")):
            return counter.wrap(original_load(*args, **kwargs))

    def load_inline(*args, **kwargs):
        with build_lock(kwargs.get("name", args[0] if args else None), kwargs.get("build_directory")):
            return counter.wrap(original_inline(*args, **kwargs))

    cpp.load, cpp.load_inline = load, load_inline
    cpp._cuda_agent_wrapped = True
    count_runtime_kernels(counter)


def count_runtime_kernels(counter: ExtensionCalls) -> None:
    """Counts launches of kernels compiled at run time by NVRTC through torch
    (`torch.cuda._compile_kernel`, or `_nvrtc_compile` with `_cuda_load_module`): each is a
    custom kernel call, as a call into a built extension is. Wrapped at the launcher's class, so
    every way torch offers to that launcher counts."""
    try:
        from torch.cuda import _utils as cu
    except ImportError:
        return
    kernel = getattr(cu, "_CudaKernel", None)
    if kernel is None or getattr(kernel, "_cuda_agent_counted", False):
        return
    launch, init = kernel.__call__, kernel.__init__

    def counted_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if "nvrtc" not in counter.modules:
            counter.modules.append("nvrtc")

    def counted_launch(self, *args, **kwargs):
        counter.count += 1
        return launch(self, *args, **kwargs)

    kernel.__init__, kernel.__call__ = counted_init, counted_launch
    kernel._cuda_agent_counted = True


def build_kernels_dir(candidate_dir: Path, device: torch.device, counter: ExtensionCalls):
    """Compiles kernels/*.cpp and kernels/*.cu into one extension, importable as `kernels_ext`
    (with -O3 and the flags of kernels/cflags.txt)."""
    kdir = candidate_dir / "kernels"
    sources = sorted(p for p in kdir.glob("*") if p.suffix in (".cpp", ".cc", ".cu")) if kdir.is_dir() else []
    if not sources:
        return None
    has_cuda = any(p.suffix == ".cu" for p in sources)
    if has_cuda and device.type != "cuda":
        raise h.RuleBreak("compile", "kernels/ holds .cu files but the evaluation device is CPU")
    import torch.utils.cpp_extension as cpp

    # kernels/cflags.txt: extra compiler flags (-fopenmp, -march=native, ...), one line.
    flags_file = kdir / "cflags.txt"
    extra = [f for f in flags_file.read_text(errors="replace").split() if f.startswith("-")][:32] if flags_file.is_file() else []
    # The build directory is named by the file names and the flags, not the contents: after a
    # change to one file, ninja recompiles that file alone and links (a binding that includes
    # the torch headers is not parsed again). Each flag set keeps its own directory.
    digest = hashlib.sha256("\0".join([p.name for p in sources] + ["--", *extra]).encode()).hexdigest()[:16]
    name = f"kernels_ext_{digest}"
    # Build from copies at a stable path inside the extension's build directory, so that a
    # cached build of the same sources is up to date for ninja wherever the candidate lives.
    # Copies are rewritten only where their text changed (ninja goes by modification times),
    # and a copy whose file is gone from kernels/ is removed: an #include must not find a
    # header that the evaluation, building from kernels/ alone, would not.
    src_dir = Path(cpp._get_build_directory(name, verbose=False)) / "src"
    src_dir.mkdir(exist_ok=True)
    files = [p for p in sorted(kdir.iterdir()) if p.is_file()]  # sources and headers alike
    present = {p.name for p in files}
    for old in src_dir.iterdir():
        if old.name not in present and old.is_file():
            old.unlink()
    for p in files:
        dest = src_dir / p.name
        data = p.read_bytes()
        if not dest.exists() or dest.read_bytes() != data:
            dest.write_bytes(data)
    with build_lock(name):
        module = cpp.load(
            name=name,
            sources=[str(src_dir / p.name) for p in sources],
            extra_cflags=["-O3", *extra],
            extra_ldflags=["-fopenmp"] if "-fopenmp" in extra else None,
            extra_cuda_cflags=["-O3"] if has_cuda else None,
            extra_include_paths=[str(src_dir)],
            with_cuda=has_cuda,
            verbose=False,
        )
    sys.modules["kernels_ext"] = counter.wrap(module)
    return module


# Compiler lines worth showing: errors (gcc, clang, nvcc, the linker) and the snippet lines that
# follow them. Notes from inside torch's own headers are left out: they are most of a failed
# build's output and name nothing the candidate wrote.
_ERROR_LINE = re.compile(r"(\berror\b|\bError\b|undefined reference|undefined symbol|multiple definition)")
_SNIPPET = re.compile(r"^\s*(\d+\s*)?\|")
_LOCATION = re.compile(r"(?P<path>[^\s:()\"']+\.(?:cpp|cc|cxx|cu|cuh|h|hpp|c))(?::(?P<line>\d+)|\((?P<pline>\d+)\))")
BUILD_ERROR_CHARS = 4000


def _source_lines(path: Path) -> list[str] | None:
    try:
        return path.read_text(errors="replace").splitlines()
    except OSError:
        return None


def _find_line(generated: list[str], line: int, candidate: list[str]) -> int | None:
    """The line of model_new.py that line `line` (1-based) of a generated source (load_inline's
    main.cpp or cuda.cu) came from: where its text and most of its neighbours' appear."""
    if not 1 <= line <= len(generated):
        return None
    text = generated[line - 1].strip()
    if not text:
        return None
    best, best_score = None, 0
    for k, c in enumerate(candidate):
        if c.strip() != text:
            continue
        score = 1 + sum(
            1 for d in (-3, -2, -1, 1, 2, 3)
            if 0 <= line - 1 + d < len(generated) and 0 <= k + d < len(candidate)
            and generated[line - 1 + d].strip() == candidate[k + d].strip())
        if score > best_score:
            best, best_score = k + 1, score
    return best


def _map_location(path: str, line: int, candidate_dir: Path, model_lines: list[str] | None) -> str | None:
    """`path:line` as the candidate knows it: kernels/<name>:line for a kernels/ source (built
    from copies of the same name), model_new.py:line for a load_inline source."""
    p = Path(path)
    if (candidate_dir / "kernels" / p.name).is_file() and "torch/include" not in path:
        return f"kernels/{p.name}:{line}"
    if p.name in ("main.cpp", "cuda.cu") and model_lines is not None:
        generated = _source_lines(p)
        if generated is not None:
            found = _find_line(generated, line, model_lines)
            if found is not None:
                return f"model_new.py:{found}"
            return f"{p.name}:{line} (generated by load_inline)"
    return None


def describe_build_error(error: BaseException, candidate_dir: Path) -> str:
    """A failed build, as the candidate needs it: the compiler's error lines once, with the
    snippet lines that follow each, locations mapped back to model_new.py and kernels/, notes
    from torch's headers and ninja's command lines left out, at most BUILD_ERROR_CHARS."""
    text = str(error)
    head = f"{type(error).__name__}"
    if "Error building extension" not in text and "error:" not in text:
        return f"{head}: {relative(text, candidate_dir)}"[:BUILD_ERROR_CHARS]
    model_lines = _source_lines(candidate_dir / "model_new.py")
    lines = text.splitlines()
    kept: list[str] = []
    errors = 0
    i = 0
    while i < len(lines):
        line = lines[i]
        if _ERROR_LINE.search(line) and "torch/include" not in line and not line.lstrip().startswith(("[", "FAILED:", "ninja:", "subprocess.", "The above exception", "Error building extension")):
            errors += 1
            shift = []

            def mapped(m):
                was = int(m.group("line") or m.group("pline"))
                to = _map_location(m.group("path"), was, candidate_dir, model_lines)
                if to is None:
                    return m.group(0)
                num = to.rsplit(":", 1)[-1]
                if num.isdigit() and not shift:
                    shift.append(int(num) - was)
                return to

            kept.append(_LOCATION.sub(mapped, line))
            j = i + 1
            while j < len(lines) and j <= i + 3 and _SNIPPET.match(lines[j]):
                snippet = lines[j]
                if shift:  # gcc's snippet numbers are the generated file's: renumber them too
                    snippet = re.sub(r"^(\s*)(\d+)(\s*\|)", lambda m: f"{m.group(1)}{int(m.group(2)) + shift[0]}{m.group(3)}", snippet)
                kept.append(snippet)
                j += 1
            i = j
            continue
        i += 1
    if not kept:  # no compiler error line: the end of the output says most
        kept = [ln for ln in lines if not ln.startswith("[")][-20:]
    body = "\n".join(kept)
    summary = f"{head}: the build failed ({errors} error line{'s' if errors != 1 else ''}; locations are in model_new.py and kernels/)"
    out = relative(f"{summary}\n{body}", candidate_dir)
    if len(out) > BUILD_ERROR_CHARS:
        cut = out[:BUILD_ERROR_CHARS]
        cut = cut[: cut.rfind("\n")] if "\n" in cut else cut
        out = f"{cut}\n[... {len(out) - len(cut)} more characters of compiler errors cut; fix the first ones]"
    return out


# The worker's own copies and compares of whole tensors go through the C library, not
# PyTorch's kernels: the server observes this process from outside and counts the time its
# forwards spend in PyTorch's compute library, which must then be the forward's own.
_memmove = ctypes.memmove
_memcmp = ctypes.CDLL(None).memcmp
_memcmp.restype = ctypes.c_int
_memcmp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]


def copy_out(dst: torch.Tensor, t: torch.Tensor) -> None:
    """Copies CPU tensor `t` into the byte tensor `dst` of its size, laid out contiguously: a
    memmove, or NumPy's strided copy for a strided output (a view), PyTorch's only for what
    NumPy cannot hold (bfloat16, a tensor that needs grad)."""
    if t.is_contiguous():
        _memmove(dst.data_ptr(), t.data_ptr(), t.numel() * t.element_size())
        return
    try:
        import numpy as np

        src = t.numpy()
        np.copyto(dst.numpy().view(src.dtype).reshape(src.shape), src, casting="no")
    except (ImportError, RuntimeError, TypeError, ValueError):
        dst.view(t.dtype).view(t.shape).copy_(t)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two CPU tensors of one layout hold the same bytes (NaNs compare by their bits)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_contiguous() and b.is_contiguous() and a.device.type == b.device.type == "cpu":
        n = a.numel() * a.element_size()
        return n == 0 or _memcmp(a.data_ptr(), b.data_ptr(), n) == 0
    return torch.equal(a, b)


def relative(text: str, candidate_dir: Path) -> str:
    """Paths inside the candidate's directory, as the candidate names them."""
    for d in {str(candidate_dir), str(candidate_dir.resolve())}:
        text = text.replace(d + "/", "")
    return text


def candidate_traceback(error: BaseException, candidate_dir: Path, limit: int = 6) -> str:
    """The frames of an exception that are the candidate's own (model_new.py and its helpers),
    innermost last, with the exception line: where in its code a failure happened."""
    if "Error building extension" in str(error):
        return ""  # a compiler's failure: its error lines say where, the Python frames do not
    roots = {str(candidate_dir), str(candidate_dir.resolve())}
    harness = {"cuda_agent_worker.py", "cuda_agent_harness.py", "cuda_agent_judge.py", "kernels_ext.py", "verify.py", "profile.py"}
    frames = [f for f in traceback.extract_tb(error.__traceback__)
              if any(f.filename.startswith(r) for r in roots) and Path(f.filename).name not in harness]
    if not frames:
        return ""
    shown = "".join(traceback.format_list(frames[-limit:]))
    return relative(f"\nTraceback (the candidate's frames, most recent call last):\n{shown}", candidate_dir).rstrip()


def load_candidate(candidate_dir: Path, device: torch.device, counter: ExtensionCalls):
    install_extension_counter(counter)
    build_kernels_dir(candidate_dir, device, counter)
    sys.path.insert(0, str(candidate_dir))  # model_new.py may import its own helpers
    path = candidate_dir / "model_new.py"
    if not path.exists():
        raise h.RuleBreak("missing_solution", "model_new.py was not written")
    module = h.load_module(path, "model_new")
    if not hasattr(module, "ModelNew"):
        raise h.RuleBreak("missing_solution", "model_new.py does not define ModelNew")
    return module


class OpTrace:
    """Records the operators the forward dispatched, two ways: a dispatch mode on the forward's
    own thread (from Python or from C++), and the profiler's operator callbacks on every thread
    of the process. A dispatch mode is per thread and can be switched off from Python; the
    profiler's callbacks sit in the dispatcher itself, so PyTorch computing on a thread of the
    candidate's own (`hidden_compute_in_thread`) or with the modes off
    (`disable_dispatch_modes_obfuscated`) is seen too."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        trace = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                trace.ops.append(func.overloadpacket.__name__)
                return func(*args, **(kwargs or {}))

        self.ops: list[str] = []
        self._mode = Mode()
        self._profiler = None
        self._events = []
        # Why the profiler's half did not run (it could not start here), or how the forward
        # broke it (it stopped or replaced the profiler: a rule break).
        self.profiler_unavailable: str | None = None
        self.profiler_broken: str | None = None

    def __enter__(self):
        try:
            self._profiler = _op_profiler()
            self._profiler.__enter__()
        except Exception as e:  # noqa: BLE001 - the dispatch mode still traces
            self._profiler, self.profiler_unavailable = None, f"{type(e).__name__}: {e}"
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        try:
            return self._mode.__exit__(*exc)
        finally:
            profiler, self._profiler = self._profiler, None
            if profiler is not None:
                try:
                    profiler.__exit__(None, None, None)
                    self._events = [e for e in profiler.events() if e.cpu_parent is None]
                except Exception as e:  # noqa: BLE001
                    self.profiler_broken = f"{type(e).__name__}: {e}"

    def forbidden(self, allowed) -> list[str]:
        seen = []

        def note(op):
            if op not in allowed and op.rstrip("_") not in allowed and op not in seen:
                seen.append(op)

        for op in self.ops:
            note(op)
        for root in self._events:
            for op in computing_ops(root, allowed):
                note(op)
        return seen


# Kineto, the profiler's backend, logs an error when it finds no GPU; nothing is wrong then.
os.environ.setdefault("KINETO_LOG_LEVEL", "5")
# Taken before any candidate code runs, like the synchronize above.
_profile = torch.profiler.profile
_profile_activity = torch.profiler.ProfilerActivity.CPU
try:
    from torch._C._profiler import _ExperimentalConfig
except ImportError:  # an older torch: the forward's own thread only
    _ExperimentalConfig = None

# Operator namespaces whose operators compute with PyTorch's kernels. Others (the
# candidate's own registered operators, `record_function` scopes) are looked through.
PYTORCH_NAMESPACES = {"aten", "prims"}


def _op_profiler():
    """The profiler's operator events of every thread, CPU side only (no CUPTI), with
    overload names (to tell operators that only decompose into others)."""
    config = None
    if _ExperimentalConfig is not None:
        config = _ExperimentalConfig(profile_all_threads=True, capture_overload_names=True)
    return _profile(activities=[_profile_activity], experimental_config=config, acc_events=True)


@functools.lru_cache(maxsize=4096)
def decomposes(name: str, overload: str) -> bool:
    """Whether an operator only decomposes into other operators (a CompositeImplicitAutograd
    kernel, such as `is_nonzero`, `reshape` or `linear`): judged by what it dispatches, as the
    dispatch mode sees it."""
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(f"{name}.{overload}" if overload else name, "CompositeImplicitAutograd")
    except RuntimeError:
        return False


def computing_ops(event, allowed) -> list[str]:
    """The operators in one profiler event's tree that compute with PyTorch: an allowed
    operator's own work (a copy's allocation, a view's strides) is not looked into, an operator
    that only decomposes is judged by its parts, any other one of PyTorch's computes."""
    found: list[str] = []
    stack = [event]
    while stack:
        e = stack.pop()
        ns, sep, op = e.name.partition("::")
        if not sep or ns not in PYTORCH_NAMESPACES:
            stack.extend(e.cpu_children)
        elif op in allowed or op.rstrip("_") in allowed:
            continue
        elif decomposes(e.name, getattr(e, "overload_name", "") or ""):
            stack.extend(e.cpu_children)
        elif op not in found:
            found.append(op)
    return found


def precision_flags() -> dict:
    return {
        "allow_tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        "allow_tf32_cudnn": torch.backends.cudnn.allow_tf32,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }


def share_weights(ref: torch.nn.Module, new: torch.nn.Module) -> dict:
    """Gives the candidate the reference's weights. Where the candidate declares a module of
    the same name and type as the reference's, every parameter and buffer of the reference's
    module must be there with its shape (a mismatch is an error that names it; tensors the
    candidate adds are its own); elsewhere a tensor is taken
    wherever its name and shape match. Returns what was not matched, both ways, so that a
    wrong output can say when the weights differed."""
    ref_state, new_state = ref.state_dict(), new.state_dict()
    ref_modules = dict(ref.named_modules())
    for mname, mod in new.named_modules():
        twin = ref_modules.get(mname)
        if not mname or twin is None or type(twin) is not type(mod):
            continue
        own = {k: v for k, v in twin.state_dict().items() if "." not in k}
        mine = {k for k in mod.state_dict() if "." not in k}
        if not own and not mine:
            continue
        try:
            for k, v in own.items():
                if k not in mine:
                    raise RuntimeError(f"missing {k!r}")
                if mod.state_dict()[k].shape != v.shape:
                    raise RuntimeError(f"{k!r} has shape {tuple(mod.state_dict()[k].shape)}, the reference's {tuple(v.shape)}")
        except RuntimeError as e:
            raise h.RuleBreak("runtime_error", f"weights: ModelNew.{mname} is a {type(mod).__name__} like the reference's Model.{mname}, but its state does not match: {e}") from e
    matched = {k: v for k, v in ref_state.items() if k in new_state and new_state[k].shape == v.shape}
    if matched:
        new.load_state_dict(matched, strict=False)
    return {
        "loaded": len(matched),
        "reference_not_loaded": sorted(k for k in ref_state if k not in matched)[:20],
        "candidate_own": sorted(k for k in new_state if k not in matched)[:20],
    }


class Worker:
    def __init__(self, args):
        self.args = args
        self.device = h.pick_device(args.device)
        self.role = args.role
        self.task = h.load_task(Path(args.task))
        self.counter = ExtensionCalls()
        self.candidate = None
        self.models: dict = {}
        self.slots: dict = {}
        self.inputs: list = []
        self.pristine: list | None = None
        self.last_out: dict = {}
        self.out_files: dict = {}
        self.allowed = ALLOWED_OPS | {op.strip() for op in (args.allow_ops or "").split(",") if op.strip()}
        try:
            # The task's own (the judge refuses a task whose list is malformed first).
            self.allowed |= set(h.task_allowed_ops(self.task))
        except ValueError:
            pass
        self.out_dir = Path(args.out_dir)
        self.build_s = 0.0

    def sync(self) -> None:
        if self.device.type == "cuda":
            (_cuda_sync or torch.cuda.synchronize)()

    def ready(self) -> dict:
        """The candidate worker's start before the lease: the imports the candidate's load and
        the trace need, with no candidate code run and no device work. On an H100 the
        candidate's start inside the lease took 7-10 s."""
        import torch.utils.cpp_extension  # noqa: F401 - what load_inline needs, imported here

        # The trace's first use imports PyTorch's dispatch-mode machinery (about 100k objects).
        with OpTrace():
            torch.zeros(2).add_(1)
        return {"ok": True}

    def hello(self, msg: dict) -> dict:
        # Where this step's time goes, for throughput work (the worker's own account: shown,
        # it decides nothing). On an H100 the candidate's hello took 7-10 s inside the lease.
        steps: dict = {}
        mark = [time.perf_counter()]

        def lap(step: str) -> None:
            now = time.perf_counter()
            steps[step] = round(now - mark[0], 3)
            mark[0] = now

        h.pin_precision()
        lap("precision")
        if self.role == "candidate":
            start = time.perf_counter()
            try:
                self.candidate = load_candidate(Path(self.args.candidate), self.device, self.counter)
            except h.RuleBreak:
                raise
            except Exception as e:  # noqa: BLE001 - any failure to build or import is the candidate's
                cdir = Path(self.args.candidate)
                raise h.RuleBreak("compile", describe_build_error(e, cdir) + candidate_traceback(e, cdir)) from e
            self.build_s = time.perf_counter() - start
            lap("import")
        elif msg.get("compile"):
            # torch.compile's own modules (2-3 s of imports), before the gate where the
            # reference's hello runs: not inside the lease. They read their cache directory's
            # path only; it is written once the lease hands it to this judge.
            import torch._dynamo  # noqa: F401
            import torch._inductor.compile_fx  # noqa: F401

            lap("compile_imports")
        # What the imports made lives as long as the process: moved out of the collector's
        # sight, so that the pass after each new model scans only what came after (a full pass
        # over torch's objects took a tenth of a second per model).
        gc.collect()
        gc.freeze()
        lap("gc")
        return {"ok": True, "pid": os.getpid(), "build_s": self.build_s, "extensions": self.counter.modules, "steps_s": steps}

    def make_model(self, msg: dict) -> dict:
        seed, kind, name = int(msg["seed"]), msg["kind"], msg["name"]
        init = self.task.get_init_inputs()
        torch.manual_seed(seed)
        ref = self.task.Model(*init).to(self.device).eval()
        if kind == "eager":
            self.models[name] = ref
        elif kind == "compile":
            if self.device.type == "cpu":
                settle_cpu_vec_isa()
            self.models[name] = torch.compile(ref)
        elif kind == "candidate" and self.role == "candidate":
            torch.manual_seed(seed)
            try:
                new = self.candidate.ModelNew(*init).to(self.device).eval()
            except Exception as e:  # noqa: BLE001
                raise h.RuleBreak("runtime_error", f"ModelNew(...) raised {type(e).__name__}: {e}{candidate_traceback(e, Path(self.args.candidate))}") from e
            weights = share_weights(ref, new)
            self.models[name] = new
            del ref
            self.last_out.pop(name, None)
            return {"ok": True, "weights": weights}
        else:
            raise ValueError(f"a {self.role} worker cannot build a {kind} model")
        self.last_out.pop(name, None)
        return {"ok": True}

    def drop(self, name: str) -> dict:
        """Frees a model the judge is done with, and its last output (the checked models
        before timing: otherwise each worker holds one more output through the timing rounds,
        2 GiB of a 16 GiB bound on a full-size softmax)."""
        self.models.pop(name, None)
        self.last_out.pop(name, None)
        f = self.out_files.pop(name, None)
        if f is not None:
            f.close()
            f.path.unlink(missing_ok=True)
        gc.collect()  # before the reply, never after one
        return {"ok": True}

    def slot(self, msg: dict) -> dict:
        old = self.slots.pop(msg["id"], None)
        if old is not None:
            old.close()
        self.slots[msg["id"]] = h.open_region(msg["region"], self.device)
        return {"ok": True}

    def load(self, msg: dict) -> dict:
        """Maps the input region for the next run. The judge writes the inputs after this
        reply, so they are read where they lie: on CPU through a new private copy-on-write
        mapping of the judge's file (new tensors at a new address; whatever the candidate writes
        stays in this process), on GPU in the judge's own memory (it sees any write to it)."""
        slot = self.slots[msg["slot"]]
        if self.device.type == "cpu":
            self.inputs = h.unpack(msg["layout"], slot.private_view())
            self.pristine = h.unpack(msg["layout"], slot.tensor)
        else:
            self.inputs = h.unpack(msg["layout"], slot.tensor)
            self.pristine = None
        return {"ok": True}

    def run(self, msg: dict) -> dict:
        name = msg["model"]
        model = self.models[name]
        self.last_out.pop(name, None)
        trace = OpTrace() if msg.get("trace") else None
        before = self.counter.count
        flags = precision_flags()
        try:
            with torch.no_grad():
                if trace is not None:
                    with trace:
                        out = model(*self.inputs)
                else:
                    out = model(*self.inputs)
            self.sync()
        except Exception as e:  # noqa: BLE001 - any crash in the forward is the candidate's
            trace = candidate_traceback(e, Path(self.args.candidate)) if self.role == "candidate" else ""
            raise h.RuleBreak("runtime_error", f"{type(e).__name__}: {e}{trace}") from e
        outputs = self.publish(name, out)
        reply = {"ok": True, "outputs": outputs}
        if trace is not None:
            if trace.profiler_broken:
                raise h.RuleBreak("pytorch_compute", f"the forward broke the worker's operator profiler ({trace.profiler_broken[:300]}): its operators could not be traced")
            reply["trace"] = {"forbidden": trace.forbidden(self.allowed)[:8], "extension_calls": self.counter.count - before}
            if trace.profiler_unavailable:
                reply["trace"]["profiler_unavailable"] = trace.profiler_unavailable[:300]
        # Both roles do the same work inside the timed call; only the candidate is held to it.
        after = precision_flags()
        if self.role == "candidate" and after != flags:
            raise h.RuleBreak("precision", f"the forward changed precision flags: {after}")
        return reply

    def inputs_intact(self) -> dict:
        """Whether the forward left its inputs as the judge wrote them (CPU: this worker's
        private copy against the judge's file). Asked by the judge after the run's reply and
        after it has copied the run's outputs: a byte-wise compare of every input is as long
        as an elementwise forward, and inside the timed call it was the candidate's alone (the
        reference worker never checked), a bias of up to a third of an elementwise task's time
        on CPU."""
        if self.role == "candidate" and self.pristine is not None:
            for i, (a, b) in enumerate(zip(self.inputs, self.pristine)):
                if isinstance(a, torch.Tensor) and not same_bytes(a, b):
                    raise h.RuleBreak("input_mutation", f"input {i} was changed in place")
        return {"ok": True}

    def publish(self, name: str, out) -> list:
        """Puts the outputs where the judge can read them: CPU, copied into this worker's
        shared file (inside the timed window, the same for every contestant); CUDA, the
        output's own memory, exported by IPC handle (no copy)."""
        flat = h.flatten_outputs(out)
        if self.device.type == "cuda":
            items = []
            for t in flat:
                if not isinstance(t, torch.Tensor):
                    items.append({"kind": "value", "value": t if isinstance(t, (bool, int, float, type(None))) else repr(t)})
                    continue
                if t.device.type != "cuda":
                    items.append({"kind": "tensor", "device": str(t.device), "shape": list(t.shape), "dtype": h.dtype_name(t.dtype)})
                    continue
                items.append({"kind": "tensor", "device": "cuda", "shape": list(t.shape), "stride": list(t.stride()), "dtype": h.dtype_name(t.dtype), "ipc": h.export_cuda_tensor(t) if t.numel() else None})
            self.last_out[name] = out  # kept alive until this model runs again
            self.sync()
            return items
        layout, offset = [], 0
        for t in flat:
            if isinstance(t, torch.Tensor):
                nbytes = t.numel() * t.element_size()
                layout.append((t, offset, nbytes))
                offset += h.aligned(nbytes)
        f = self.out_files.get(name)
        if f is None:
            f = self.out_files[name] = h.FileRegion.create(self.out_dir / f"out-{name}.bin", max(offset, h.ALIGN))
        f.grow(offset)
        items, k = [], 0
        for t in flat:
            if not isinstance(t, torch.Tensor):
                items.append({"kind": "value", "value": t if isinstance(t, (bool, int, float, type(None))) else repr(t)})
                continue
            _, off, nbytes = layout[k]
            k += 1
            if t.device.type != self.device.type:
                items.append({"kind": "tensor", "device": str(t.device), "shape": list(t.shape), "dtype": h.dtype_name(t.dtype)})
                continue
            if nbytes:
                copy_out(f.tensor[off: off + nbytes], t)
            items.append({"kind": "tensor", "device": "cpu", "shape": list(t.shape), "dtype": h.dtype_name(t.dtype), "offset": off, "nbytes": nbytes, "file_bytes": f.nbytes})
        return items

    def handle(self, msg: dict) -> dict:
        op = msg.get("op")
        if op == "ready":
            return self.ready()
        if op == "hello":
            return self.hello(msg)
        if op == "model":
            return self.make_model(msg)
        if op == "slot":
            return self.slot(msg)
        if op == "load":
            return self.load(msg)
        if op == "run":
            return self.run(msg)
        if op == "inputs":
            return self.inputs_intact()
        if op == "stats":
            return {"ok": True, **memory_stats(self.device)}
        if op == "drop":
            return self.drop(msg["name"])
        raise ValueError(f"unknown op {op!r}")


# What the vector-ISA probe memo did in this process (see settle_cpu_vec_isa): probes run,
# probes answered from the record.
VEC_ISA_PROBES = {"ran": 0, "remembered": 0}


def settle_cpu_vec_isa() -> str:
    """torch.compile on CPU first finds which vector ISAs the compiler can build for: per ISA
    the CPU claims (and again for AVX-512 BF16 and VNNI), a probe compiled once (cached on
    disk) and then loaded by a fresh Python that imports torch, which is not cached: 4-8 s of
    every process's first compile on a 2-core machine, the most of a warm-cache compile
    baseline. Each probe that passed is remembered beside inductor's cache, keyed by what
    decides it (torch, the Python, the compilers, the ISA's flags, the probe's code); later
    processes answer those probes from the record and run the rest as inductor does. A probe
    that failed is never recorded: it runs again. Returns what it did, for tests."""
    import platform
    import shutil

    # Only a moved internal is left to inductor; any other failure of the import (a cache
    # directory it cannot write) is the real error, and torch.compile's own import would
    # hide it behind a half-imported module.
    try:
        from torch._inductor import config, cpu_vec_isa
        from torch._inductor.runtime.cache_dir_utils import cache_dir
    except ImportError:
        return "left to inductor"
    try:
        if platform.machine() not in ("x86_64", "AMD64"):
            return "not x86"
        if getattr(cpu_vec_isa.VecISA.check_build, "_cuda_agent_memo", False):
            return "already settled"
        compilers = []
        for c in config.cpp.cxx:
            path = shutil.which(c) if c else None
            if path:
                st = os.stat(path)
                compilers.append(f"{os.path.realpath(path)}:{st.st_size}:{st.st_mtime_ns}")
        machine = json.dumps([torch.__version__, sys.executable, compilers])
        records = Path(cache_dir()) / "cuda-agent-vec-isa"
        probe = cpu_vec_isa.VecISA.check_build

        def check_build(isa, code: str) -> bool:
            key = hashlib.sha256(json.dumps([machine, str(isa._arch_flags), code]).encode()).hexdigest()[:32]
            record = records / f"{key}.passed"
            if record.is_file():
                VEC_ISA_PROBES["remembered"] += 1
                return True
            VEC_ISA_PROBES["ran"] += 1
            ok = probe(isa, code)
            if ok:
                records.mkdir(parents=True, exist_ok=True)
                tmp = record.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_text(str(isa))
                os.replace(tmp, record)
            return ok

        check_build._cuda_agent_memo = True
        cpu_vec_isa.VecISA.check_build = check_build
        return "probes remembered"
    except Exception:  # noqa: BLE001 - an internal of torch moved: inductor checks by itself
        return "left to inductor"


def memory_stats(device) -> dict:
    """This process's peak memory: resident host memory and, on CUDA, what torch's allocator
    reserved at most (informational: it decides nothing)."""
    stats = {"peak_rss_bytes": h.peak_rss_bytes(os.getpid())}
    if device.type == "cuda":
        stats["peak_cuda_reserved_bytes"] = torch.cuda.max_memory_reserved()
    return stats


def scope_signals() -> bool:
    """Puts this process in a landlock domain of its own that scopes signals (landlock ABI 6+):
    nothing it runs can signal a process outside it, such as the judge that started it with the
    same uid. Best effort: an older kernel leaves it unscoped.

    Every landlock layer denies moving a file to another directory (the REFER right) unless a
    rule of that layer grants it, even one that handles no other file access. Inside a
    sandbox's own layer this one would then refuse every cross-directory rename (Triton's cache
    writes each file in a temporary directory and moves it up: torch.compile failed with EXDEV
    on CUDA), so it grants REFER beneath `/` and leaves the files to the sandbox's layer."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)

    class Attr(ctypes.Structure):
        _fields_ = [("fs", ctypes.c_uint64), ("net", ctypes.c_uint64), ("scoped", ctypes.c_uint64)]

    class PathBeneath(ctypes.Structure):
        _pack_ = 1
        _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]

    refer = 1 << 13  # LANDLOCK_ACCESS_FS_REFER
    if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS, which landlock requires
        return False
    attr = Attr(refer, 0, 2)  # LANDLOCK_SCOPE_SIGNAL
    fd = libc.syscall(444, ctypes.byref(attr), ctypes.sizeof(attr), 0)  # landlock_create_ruleset
    if fd < 0:
        return False
    try:
        root = os.open("/", os.O_PATH | os.O_CLOEXEC)
        try:
            rule = PathBeneath(refer, root)
            if libc.syscall(445, fd, 1, ctypes.byref(rule), 0) != 0:  # landlock_add_rule, PATH_BENEATH
                return False
        finally:
            os.close(root)
        return libc.syscall(446, fd, 0) == 0  # landlock_restrict_self
    finally:
        os.close(fd)


def settle_malloc() -> bool:
    """Fixes glibc's allocator to one state in every worker: blocks up to 32 MiB (its largest
    mmap threshold) from the heap, and 64 MiB kept at the heap's top when it is trimmed. Left
    dynamic, the thresholds follow each process's history of frees, and two workers running the
    same forward differed: on a 2-core CPU the reference worker got fresh pages for every 31 MB
    output of ReLU (8000 page faults a call, 50 ms) and the candidate's reused its heap (440
    faults, 19 ms): the reference's own forward as the candidate measured 2.4x faster than
    itself. Both roles, whoever started them, settle it here before the task is loaded."""
    try:
        libc = ctypes.CDLL(None)
        m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3
        return all(libc.mallopt(opt, value) for opt, value in ((m_mmap_threshold, 32 << 20), (m_trim_threshold, 64 << 20), (m_top_pad, 64 << 20)))
    except (OSError, AttributeError):  # not glibc: its allocator is left as it is
        return False


def serve(args) -> int:
    scope_signals()
    settle_malloc()
    if args.fds:
        r, w = (int(x) for x in args.fds.split(","))
        channel = h.Channel(r, w)
    else:
        channel = h.Channel.open_paths(args.req, args.rep, reader_first=True)
    worker = Worker(args)
    gc.disable()  # no collector pass lands after a reply, where it would look like late work
    while True:
        try:
            msg = channel.recv()
        except (h.ChannelClosed, EOFError):
            return 0
        if msg.get("op") == "exit":
            return 0
        seq = msg.get("seq")
        try:
            reply = worker.handle(msg)
        except h.RuleBreak as e:
            reply = {"ok": False, "rule": e.rule, "message": str(e)}
        except Exception as e:  # noqa: BLE001 - reported to the judge, which decides
            reply = {"ok": False, "rule": "runtime_error", "message": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
        reply["seq"] = seq
        if msg.get("op") == "model":
            gc.collect()  # cycles freed with the old model; before the reply, never after one
        channel.send(reply)


def needs_gpu(e: BaseException) -> bool:
    """Whether an import failed for want of a visible GPU rather than for its own fault."""
    text = str(e)
    if "Error building extension" in text:
        return False
    return any(k in text for k in ("No CUDA GPUs are available", "no CUDA-capable device", "Found no NVIDIA driver", "CUDA driver initialization failed",
                                   "invalid device ordinal"))


def build(args) -> int:
    # The server builds with no GPU visible (nvcc needs none, and a build must not disturb the
    # device another evaluation is timing on): a CUDA build names the device without using it.
    hidden_gpu = args.device.startswith("cuda") and not torch.cuda.is_available()
    device = torch.device(args.device) if hidden_gpu else h.pick_device(args.device)
    counter = ExtensionCalls()
    start = time.perf_counter()
    try:
        h.pin_precision()
        load_candidate(Path(args.candidate), device, counter)
        result = {"built": True, "build_s": time.perf_counter() - start, "extensions": counter.modules}
    except h.RuleBreak as e:
        result = {"built": False, "rule": e.rule, "reason": f"{e.rule}: {e}"}
    except Exception as e:  # noqa: BLE001 - any failure to build is the candidate's
        cdir = Path(args.candidate)
        if hidden_gpu and needs_gpu(e):
            # model_new.py touches the GPU at import (after or between its builds): what is
            # left of its import runs in the evaluation's worker, which sees the GPU.
            result = {"built": True, "build_s": time.perf_counter() - start, "extensions": counter.modules,
                      "deferred": f"the import needs the GPU ({type(e).__name__}: {str(e)[:200]})"}
        else:
            result = {"built": False, "rule": "compile", "reason": f"compile: {describe_build_error(e, cdir)}{candidate_traceback(e, cdir)}"}
    sys.stdout.flush()
    os.write(1, (json.dumps(result) + "\n").encode())
    return 0


def main() -> int:
    # A crash in native code (a segfault in a kernel) leaves the Python traceback of every
    # thread on stderr, which the judge (locally) and the server (as diagnostics) show.
    faulthandler.enable(all_threads=True)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="compile the candidate's extensions")
    b.add_argument("--task", required=True)
    b.add_argument("--candidate", required=True)
    b.add_argument("--device", default="auto")
    s = sub.add_parser("serve", help="answer the judge on a channel")
    s.add_argument("--role", choices=["candidate", "reference"], required=True)
    s.add_argument("--task", required=True)
    s.add_argument("--candidate")
    s.add_argument("--device", default="auto")
    s.add_argument("--fds", help="R,W: inherited descriptors of the channel")
    s.add_argument("--req", help="FIFO the judge writes requests to")
    s.add_argument("--rep", help="FIFO this worker writes replies to")
    s.add_argument("--out-dir", required=True, help="where this worker's output files go")
    s.add_argument("--allow-ops")
    args = p.parse_args()
    if args.cmd == "build":
        return build(args)
    return serve(args)


if __name__ == "__main__":
    h.exit_now(main())
