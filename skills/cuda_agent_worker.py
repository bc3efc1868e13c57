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
import faulthandler
import gc
import hashlib
import json
import os
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
        raise h.RuleBreak("compile", "kernels/ holds .cu files but the evaluation device is CPU")
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
    module = cpp.load(
        name=name,
        sources=[str(src_dir / p.name) for p in sources],
        extra_cflags=["-O3"],
        extra_cuda_cflags=["-O3"] if has_cuda else None,
        extra_include_paths=[str(src_dir)],
        with_cuda=has_cuda,
        verbose=False,
    )
    sys.modules["kernels_ext"] = counter.wrap(module)
    return module


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

    def forbidden(self, allowed) -> list[str]:
        seen = []
        for op in self.ops:
            if op not in allowed and op.rstrip("_") not in allowed and op not in seen:
                seen.append(op)
        return seen


def precision_flags() -> dict:
    return {
        "allow_tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        "allow_tf32_cudnn": torch.backends.cudnn.allow_tf32,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
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
        self.out_dir = Path(args.out_dir)
        self.build_s = 0.0

    def sync(self) -> None:
        if self.device.type == "cuda":
            (_cuda_sync or torch.cuda.synchronize)()

    def hello(self) -> dict:
        h.pin_precision()
        if self.role == "candidate":
            start = time.perf_counter()
            try:
                self.candidate = load_candidate(Path(self.args.candidate), self.device, self.counter)
            except h.RuleBreak:
                raise
            except Exception as e:  # noqa: BLE001 - any failure to build or import is the candidate's
                raise h.RuleBreak("compile", f"{type(e).__name__}: {e}") from e
            self.build_s = time.perf_counter() - start
        return {"ok": True, "pid": os.getpid(), "build_s": self.build_s, "extensions": self.counter.modules}

    def make_model(self, msg: dict) -> dict:
        seed, kind, name = int(msg["seed"]), msg["kind"], msg["name"]
        init = self.task.get_init_inputs()
        torch.manual_seed(seed)
        ref = self.task.Model(*init).to(self.device).eval()
        if kind == "eager":
            self.models[name] = ref
        elif kind == "compile":
            self.models[name] = torch.compile(ref)
        elif kind == "candidate" and self.role == "candidate":
            torch.manual_seed(seed)
            try:
                new = self.candidate.ModelNew(*init).to(self.device).eval()
            except Exception as e:  # noqa: BLE001
                raise h.RuleBreak("runtime_error", f"ModelNew(...) raised {type(e).__name__}: {e}") from e
            # Same weights: the reference's parameters wherever names and shapes match.
            new_state = new.state_dict()
            matched = {k: v for k, v in ref.state_dict().items() if k in new_state and new_state[k].shape == v.shape}
            if matched:
                new.load_state_dict(matched, strict=False)
            self.models[name] = new
            del ref
        else:
            raise ValueError(f"a {self.role} worker cannot build a {kind} model")
        self.last_out.pop(name, None)
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
            raise h.RuleBreak("runtime_error", f"{type(e).__name__}: {e}") from e
        outputs = self.publish(name, out)
        reply = {"ok": True, "outputs": outputs}
        if trace is not None:
            reply["trace"] = {"forbidden": trace.forbidden(self.allowed)[:8], "extension_calls": self.counter.count - before}
        if self.role == "candidate":
            if precision_flags() != flags:
                raise h.RuleBreak("precision", f"the forward changed precision flags: {precision_flags()}")
            if self.pristine is not None:
                for i, (a, b) in enumerate(zip(self.inputs, self.pristine)):
                    if isinstance(a, torch.Tensor) and not torch.equal(a, b):
                        raise h.RuleBreak("input_mutation", f"input {i} was changed in place")
        return reply

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
                f.tensor[off: off + nbytes].view(t.dtype).view(t.shape).copy_(t)
            items.append({"kind": "tensor", "device": "cpu", "shape": list(t.shape), "dtype": h.dtype_name(t.dtype), "offset": off, "nbytes": nbytes, "file_bytes": f.nbytes})
        return items

    def handle(self, msg: dict) -> dict:
        op = msg.get("op")
        if op == "hello":
            return self.hello()
        if op == "model":
            return self.make_model(msg)
        if op == "slot":
            return self.slot(msg)
        if op == "load":
            return self.load(msg)
        if op == "run":
            return self.run(msg)
        if op == "stats":
            return {"ok": True, **memory_stats(self.device)}
        raise ValueError(f"unknown op {op!r}")


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
    same uid. Best effort: an older kernel leaves it unscoped."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)

    class Attr(ctypes.Structure):
        _fields_ = [("fs", ctypes.c_uint64), ("net", ctypes.c_uint64), ("scoped", ctypes.c_uint64)]

    if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS, which landlock requires
        return False
    attr = Attr(0, 0, 2)  # LANDLOCK_SCOPE_SIGNAL
    fd = libc.syscall(444, ctypes.byref(attr), ctypes.sizeof(attr), 0)  # landlock_create_ruleset
    if fd < 0:
        return False
    ok = libc.syscall(446, fd, 0) == 0  # landlock_restrict_self
    os.close(fd)
    return ok


def serve(args) -> int:
    scope_signals()
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


def build(args) -> int:
    device = h.pick_device(args.device)
    counter = ExtensionCalls()
    start = time.perf_counter()
    try:
        h.pin_precision()
        load_candidate(Path(args.candidate), device, counter)
        result = {"built": True, "build_s": time.perf_counter() - start, "extensions": counter.modules}
    except h.RuleBreak as e:
        result = {"built": False, "rule": e.rule, "reason": f"{e.rule}: {e}"}
    except Exception as e:  # noqa: BLE001 - any failure to build is the candidate's
        result = {"built": False, "rule": "compile", "reason": f"compile: {type(e).__name__}: {e}"}
    sys.stdout.flush()
    os.write(1, (json.dumps(result) + "\n").encode())
    return 0


def main() -> int:
    faulthandler.enable()  # a crash in native code leaves a Python traceback on stderr
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
    sys.exit(main())
