"""Shared pieces of the cuda-agent evaluation harness.

The evaluation is two kinds of process (docs/EVALUATION.md has the threat model):

- the judge (`cuda_agent_judge.py`, trusted) makes the inputs, compares outputs, keeps the clock
  and decides the verdict; it never imports candidate code;
- workers (`cuda_agent_worker.py`) build and run one kind of model each: the candidate's
  `ModelNew` in an untrusted worker, the reference `Model` (eager and torch.compile) in a
  trusted one.

This module holds what both sides need: task loading, the tolerance table, input layouts, the
shared-memory regions inputs and outputs cross by, and the length-prefixed message channel.
verify.py, profile.py and evaluate.py are thin front ends over the judge.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import math
import os
import select
import struct
import sys
import time
import types
from pathlib import Path

# The judge's own OpenMP threads (its compares, checksums, input writes) sleep once their work
# is done instead of spinning for a while on a core, where they would take CPU from the
# contestant the judge calls next (after the candidate's call the judge checksums its output;
# after eager's it does not). Read by OpenMP when torch loads it; the workers get it too.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

# Precision flags are pinned so that eager, compile and the candidate are compared alike.
PINNED_FLAGS = {"allow_tf32_matmul": False, "allow_tf32_cudnn": False, "float32_matmul_precision": "highest"}

# Default tolerances by output dtype: (atol, rtol).
TOLERANCE = {
    torch.float32: (1e-4, 1e-4),
    torch.float64: (1e-6, 1e-6),
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (1e-2, 1e-2),
}

# Largest message either side accepts on a channel: replies carry metadata only.
MAX_MESSAGE = 1 << 20
# Shared regions are laid out at this alignment (covers float4/int4 vector loads).
ALIGN = 256


class RuleBreak(Exception):
    """The candidate broke an evaluation rule; `rule` names it."""

    def __init__(self, rule: str, message: str):
        super().__init__(message)
        self.rule = rule


def exit_now(code: int) -> None:
    """Ends the process once its output is flushed, without the interpreter's teardown: with
    torch loaded that is seconds (torch.compile's worker pools, the CUDA context), spent on a
    leased device by the judge and its workers; none of it decides anything."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def pin_precision() -> dict:
    torch.backends.cuda.matmul.allow_tf32 = PINNED_FLAGS["allow_tf32_matmul"]
    torch.backends.cudnn.allow_tf32 = PINNED_FLAGS["allow_tf32_cudnn"]
    torch.set_float32_matmul_precision(PINNED_FLAGS["float32_matmul_precision"])
    return dict(PINNED_FLAGS)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda asked for, but torch sees no CUDA device")
    return torch.device(name)


def synchronize(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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


class Progress:
    """Prints the judge's progress lines for verify.py and profile.py, and while a step is
    silent for `heartbeat_s` (a build on a loaded host takes minutes) a line saying it still
    runs, so that the output shows where the time goes, and a command cut by its timeout
    shows how far it got. Call `close()` when done."""

    def __init__(self, out, heartbeat_s: float = 30.0):
        import threading
        self.out = out
        self.heartbeat_s = heartbeat_s
        self.started = time.perf_counter()
        self.last_line = ""
        self.last_at = self.started
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.thread = None
        if heartbeat_s > 0:
            self.thread = threading.Thread(target=self._beat, name="progress-heartbeat", daemon=True)
            self.thread.start()

    def __call__(self, line: str) -> None:
        with self.lock:
            self.last_line = line.split("] ", 1)[-1]
            self.last_at = time.perf_counter()
            print(line, file=self.out, flush=True)

    def _beat(self) -> None:
        while not self.done.wait(self.heartbeat_s / 4):
            with self.lock:
                now = time.perf_counter()
                if self.last_line and now - self.last_at >= self.heartbeat_s:
                    print(f"[{now - self.started:6.1f} s] still running: {self.last_line}", file=self.out, flush=True)
                    self.last_at = now

    def close(self) -> None:
        self.done.set()
        if self.thread is not None:
            self.thread.join()


def task_allowed_ops(task) -> list[str]:
    """The aten operators a task lets candidates dispatch beyond the harness's own list: its
    `ALLOW_OPS`, such as `("mm", "addmm")` for a module whose nn.Linear may stay PyTorch's.
    Set by whoever wrote the task, never by the candidate (model.py is read-only to it).
    Raises ValueError where it is not a list or tuple of operator names."""
    ops = getattr(task, "ALLOW_OPS", ())
    if not isinstance(ops, (list, tuple)) or not all(isinstance(o, str) and o.strip() and o.strip().replace("_", "").replace(".", "").isalnum() for o in ops):
        raise ValueError(f"the task's ALLOW_OPS must be a list or tuple of aten operator names (such as ('mm', 'addmm')), not {ops!r:.200}")
    return sorted({o.strip() for o in ops})


def inputs_on(make, device) -> list:
    """`make()`'s inputs, created on `device` itself. Full-size tasks take gigabytes per tensor;
    made on the host first they would need that much host memory again and a slow copy."""
    with torch.device(device):
        out = list(make())
    return [x.to(device) if isinstance(x, torch.Tensor) else x for x in out]


def seeded_inputs(make, seed: int, device) -> list:
    torch.manual_seed(seed)
    return inputs_on(make, device)


def flatten_outputs(out) -> list:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in flatten_outputs(o)]
    return [out]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


# ---------------------------------------------------------------------------------------------
# Input layouts: one input set packed into one flat region.


# Each input set starts at a random multiple of ALIGN below this in its region: the inputs'
# addresses change from one set to the next at the cost of this much memory, not of a second
# region (a kernel that keys a cache on its input pointers meets new ones every round).
INPUT_SHIFT_SLOTS = 64


def input_layout(inputs: list, base: int = 0) -> tuple[list[dict], int]:
    """Where each input lives in a packed region that starts at `base` (a multiple of ALIGN),
    and the bytes the region needs. Tensors are packed contiguous and aligned; plain values
    (ints, floats, None) travel in the message."""
    layout, offset = [], base
    for x in inputs:
        if isinstance(x, torch.Tensor):
            nbytes = x.numel() * x.element_size()
            layout.append({"kind": "tensor", "shape": list(x.shape), "dtype": dtype_name(x.dtype), "offset": offset, "nbytes": nbytes})
            offset += aligned(nbytes)
        elif x is None or isinstance(x, (bool, int, float, str)):
            layout.append({"kind": "value", "value": x})
        else:
            raise TypeError(f"get_inputs() returned a {type(x).__name__}: only tensors and plain values can be passed")
    return layout, max(offset, ALIGN)


def pack_inputs(inputs: list, layout: list[dict], region: torch.Tensor) -> None:
    """Copies `inputs` into the uint8 tensor `region` at the layout's offsets."""
    for x, item in zip(inputs, layout):
        if item["kind"] == "tensor":
            dst = region[item["offset"]: item["offset"] + item["nbytes"]]
            dst.copy_(x.contiguous().reshape(-1).view(torch.uint8))


def unpack(layout: list[dict], region: torch.Tensor) -> list:
    """Typed views into the uint8 tensor `region`, one per layout item (values as given)."""
    out = []
    for item in layout:
        if item["kind"] == "value":
            out.append(item["value"])
            continue
        raw = region[item["offset"]: item["offset"] + item["nbytes"]]
        out.append(raw.view(dtype_of(item["dtype"])).view(item["shape"]))
    return out


# ---------------------------------------------------------------------------------------------
# Shared regions. CPU: a file mapped by both processes. CUDA: device memory allocated with the
# driver (one allocation per region, so no unrelated data shares it) and opened by the peer
# through a CUDA IPC handle.


class FileRegion:
    """A file-backed region. The creator owns the file; a peer maps it read-only or copies it."""

    def __init__(self, path: Path, nbytes: int, fd: int, writable: bool):
        import mmap

        self.path, self.nbytes = Path(path), nbytes
        self._fd = fd
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        self._map = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=prot)
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a read-only buffer is what we mean
            self.tensor = torch.frombuffer(self._map, dtype=torch.uint8, count=nbytes)

    @classmethod
    def create(cls, path: Path, nbytes: int, mode: int = 0o644) -> "FileRegion":
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
        os.fchmod(fd, mode)  # the umask must not narrow who may read it
        os.ftruncate(fd, nbytes)
        return cls(path, nbytes, fd, writable=True)

    @classmethod
    def open_peer(cls, path: Path, nbytes: int, owner: int | None = None) -> "FileRegion":
        """Maps a file the other side made: regular, not a link, at least `nbytes` long and,
        when `owner` is given, owned by that uid."""
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            import stat as stat_mod

            if not stat_mod.S_ISREG(st.st_mode):
                raise RuleBreak("protocol", f"{path.name} is not a regular file")
            if owner is not None and st.st_uid != owner:
                raise RuleBreak("protocol", f"{path.name} is owned by uid {st.st_uid}, not {owner}")
            if st.st_size < nbytes:
                raise RuleBreak("protocol", f"{path.name} holds {st.st_size} bytes, {nbytes} announced")
        except BaseException:
            os.close(fd)
            raise
        return cls(path, nbytes, fd, writable=False)

    def private_view(self) -> torch.Tensor:
        """A new copy-on-write mapping of the file: pages it has not written show the file as
        it is (writes made to the file later included); pages it writes stay in this process
        and never reach the file. (No MAP_POPULATE: on a writable private mapping it would copy
        every page now and hide the file's later contents.)"""
        import mmap
        import warnings

        m = mmap.mmap(self._fd, self.nbytes, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.frombuffer(m, dtype=torch.uint8, count=self.nbytes)

    def grow(self, nbytes: int) -> None:
        """Owner only: makes the file at least `nbytes` long and remaps it."""
        if nbytes <= self.nbytes:
            return
        self.close(keep_fd=True)
        os.ftruncate(self._fd, nbytes)
        self.__init__(self.path, nbytes, self._fd, writable=True)

    def describe(self) -> dict:
        return {"kind": "file", "path": str(self.path), "nbytes": self.nbytes}

    def close(self, keep_fd: bool = False) -> None:
        self.tensor = None
        try:
            self._map.close()
        except BufferError:
            pass  # a view is still alive somewhere: the mapping goes when it does
        if not keep_fd:
            os.close(self._fd)


class PeerFile:
    """A file the other side writes, read by copying (never mapped: a peer that truncates
    its file under a mapping would crash the reader with SIGBUS). Regular, not a link and,
    when `owner` is given, owned by that uid."""

    MAX = 64 << 30

    def __init__(self, path: Path, owner: int | None = None):
        import stat as stat_mod

        self.path = Path(path)
        try:
            self._fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as e:
            raise RuleBreak("protocol", f"{self.path.name}: {e.strerror}") from e
        st = os.fstat(self._fd)
        if not stat_mod.S_ISREG(st.st_mode) or (owner is not None and st.st_uid != owner):
            os.close(self._fd)
            raise RuleBreak("protocol", f"{self.path.name} is not a regular file of the worker's")

    def size(self) -> int:
        return os.fstat(self._fd).st_size

    def read(self, offset: int, nbytes: int) -> torch.Tensor:
        if nbytes > self.MAX:
            raise RuleBreak("protocol", f"{self.path.name}: {nbytes} bytes announced")
        if offset + nbytes > self.size():
            raise RuleBreak("protocol", f"{self.path.name} ends before the {nbytes} bytes announced at {offset}")
        out = torch.empty(nbytes, dtype=torch.uint8)
        view = memoryview(out.numpy()).cast("B")
        done = 0
        while done < nbytes:
            try:
                n = os.preadv(self._fd, [view[done:]], offset + done)
            except OSError as e:
                raise RuleBreak("protocol", f"{self.path.name}: {e.strerror} reading {nbytes} bytes at {offset}") from e
            if n <= 0:
                raise RuleBreak("protocol", f"{self.path.name} ends before the {nbytes} bytes announced at {offset}")
            done += n
        return out

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class IpcHandle(ctypes.Structure):
    """CUipcMemHandle: 64 opaque bytes, passed by value."""

    _fields_ = [("reserved", ctypes.c_ubyte * 64)]


def ipc_handle_struct(handle_hex: str) -> IpcHandle:
    """The handle as the driver takes it, every byte as it was exported. (Assigning bytes to a
    `c_char` array field stops at the first NUL, and IPC handles hold NULs: the driver then
    answers CUDA_ERROR_INVALID_VALUE, measured on an H200.)"""
    raw = bytes.fromhex(handle_hex)
    if len(raw) != 64:
        raise ValueError(f"a CUDA IPC handle is 64 bytes, not {len(raw)}")
    h = IpcHandle()
    ctypes.memmove(ctypes.addressof(h), raw, 64)
    return h


class _CudaDriver:
    """The few CUDA driver calls the regions need, through ctypes (libcuda ships with the
    driver on every CUDA machine)."""

    _instance = None

    def __init__(self):
        self.lib = ctypes.CDLL("libcuda.so.1")
        torch.cuda.init()
        torch.zeros(1, device="cuda")  # makes torch's primary context current on this thread

    @classmethod
    def get(cls) -> "_CudaDriver":
        if cls._instance is None:
            cls._instance = cls()
        return cls._instance

    def _fn(self, *names):
        for name in names:
            fn = getattr(self.lib, name, None)
            if fn is not None:
                return fn
        raise OSError(f"libcuda has none of {names}")

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            raise OSError(f"{what} failed with CUresult {rc}")

    def alloc(self, nbytes: int) -> int:
        ptr = ctypes.c_uint64()
        self._check(self._fn("cuMemAlloc_v2", "cuMemAlloc")(ctypes.byref(ptr), ctypes.c_size_t(nbytes)), "cuMemAlloc")
        return ptr.value

    def free(self, ptr: int) -> None:
        self._fn("cuMemFree_v2", "cuMemFree")(ctypes.c_uint64(ptr))

    def address_range(self, ptr: int) -> tuple[int, int]:
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        self._check(self._fn("cuMemGetAddressRange_v2", "cuMemGetAddressRange")(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr)), "cuMemGetAddressRange")
        return base.value, size.value

    def ipc_handle(self, base: int) -> str:
        handle = (ctypes.c_char * 64)()
        self._check(self.lib.cuIpcGetMemHandle(handle, ctypes.c_uint64(base)), "cuIpcGetMemHandle")
        return bytes(handle).hex()

    def ipc_open(self, handle_hex: str) -> int:
        ptr = ctypes.c_uint64()
        h = ipc_handle_struct(handle_hex)
        fn = self._fn("cuIpcOpenMemHandle_v2", "cuIpcOpenMemHandle")
        fn.argtypes = [ctypes.POINTER(ctypes.c_uint64), IpcHandle, ctypes.c_uint]
        self._check(fn(ctypes.byref(ptr), h, 1), "cuIpcOpenMemHandle")  # 1: lazy peer access
        return ptr.value

    def ipc_close(self, ptr: int) -> None:
        self.lib.cuIpcCloseMemHandle(ctypes.c_uint64(ptr))


class _DeviceArray:
    """A raw device pointer as torch sees foreign memory (no copy)."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3, "strides": None}


def device_view(ptr: int, nbytes: int, device) -> torch.Tensor:
    return torch.as_tensor(_DeviceArray(ptr, nbytes), device=device)


class CudaRegion:
    """Device memory shared through a CUDA IPC handle."""

    def __init__(self, ptr: int, nbytes: int, handle: str, owned: bool, device):
        self.ptr, self.nbytes, self.handle, self._owned = ptr, nbytes, handle, owned
        self.tensor = device_view(ptr, nbytes, device)

    @classmethod
    def create(cls, nbytes: int, device) -> "CudaRegion":
        drv = _CudaDriver.get()
        ptr = drv.alloc(nbytes)
        return cls(ptr, nbytes, drv.ipc_handle(ptr), owned=True, device=device)

    @classmethod
    def open_peer(cls, handle: str, nbytes: int, device) -> "CudaRegion":
        return cls(_CudaDriver.get().ipc_open(handle), nbytes, handle, owned=False, device=device)

    def describe(self) -> dict:
        return {"kind": "cuda", "handle": self.handle, "nbytes": self.nbytes}

    def close(self) -> None:
        self.tensor = None
        drv = _CudaDriver.get()
        (drv.free if self._owned else drv.ipc_close)(self.ptr)


def export_cuda_tensor(t: torch.Tensor) -> dict:
    """What a peer needs to map `t`'s memory: the IPC handle of its allocation and where in it
    the tensor starts."""
    drv = _CudaDriver.get()
    base, size = drv.address_range(t.data_ptr())
    return {"handle": drv.ipc_handle(base), "alloc_bytes": size, "offset": t.data_ptr() - base}


def open_region(desc: dict, device, owner: int | None = None):
    if desc["kind"] == "file":
        return FileRegion.open_peer(Path(desc["path"]), int(desc["nbytes"]), owner)
    if desc["kind"] == "cuda":
        return CudaRegion.open_peer(desc["handle"], int(desc["nbytes"]), device)
    raise ValueError(f"unknown region kind {desc['kind']!r}")


# ---------------------------------------------------------------------------------------------
# The channel: length-prefixed JSON messages over a pair of pipes (or FIFOs).


class ChannelClosed(Exception):
    """The peer closed its end."""


class Channel:
    def __init__(self, rfd: int, wfd: int):
        self.rfd, self.wfd = rfd, wfd

    @classmethod
    def open_paths(cls, read_path: str, write_path: str, reader_first: bool) -> "Channel":
        # FIFOs block on open until the other end opens: both sides open in the same order.
        if reader_first:
            r = os.open(read_path, os.O_RDONLY | os.O_CLOEXEC)
            w = os.open(write_path, os.O_WRONLY | os.O_CLOEXEC)
        else:
            w = os.open(write_path, os.O_WRONLY | os.O_CLOEXEC)
            r = os.open(read_path, os.O_RDONLY | os.O_CLOEXEC)
        return cls(r, w)

    def send(self, msg: dict) -> None:
        data = json.dumps(msg, separators=(",", ":")).encode()
        buf = struct.pack(">I", len(data)) + data
        view = memoryview(buf)
        while view:
            n = os.write(self.wfd, view)
            view = view[n:]

    def _read_exact(self, n: int, deadline: float | None) -> bytes:
        chunks, need = [], n
        while need:
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([self.rfd], [], [], left)[0]:
                    raise TimeoutError
            chunk = os.read(self.rfd, need)
            if not chunk:
                raise ChannelClosed
            chunks.append(chunk)
            need -= len(chunk)
        return b"".join(chunks)

    def recv(self, timeout: float | None = None) -> dict:
        """One message. Raises TimeoutError, ChannelClosed, or ValueError for garbage."""
        deadline = None if timeout is None else time.monotonic() + timeout
        (n,) = struct.unpack(">I", self._read_exact(4, deadline))
        if n > MAX_MESSAGE:
            raise ValueError(f"a {n}-byte message (the limit is {MAX_MESSAGE})")
        try:
            msg = json.loads(self._read_exact(n, deadline))
        except RecursionError:
            raise ValueError("a message nested too deep") from None
        if not isinstance(msg, dict):
            raise ValueError("a message that is not an object")
        return msg

    def pending(self) -> bool:
        """Whether the peer has written something nobody asked for yet."""
        return bool(select.select([self.rfd], [], [], 0)[0])


# ---------------------------------------------------------------------------------------------
# Comparison: chunked, so that a multi-gigabyte output needs no full-size temporaries.

CHUNK = 1 << 24


def _classify(n: torch.Tensor, r: torch.Tensor) -> str:
    if n.is_floating_point() and torch.isnan(n).any() and not torch.isnan(r).any():
        return "NaN where the reference has numbers (an output element never written?)"
    if n.is_floating_point() and torch.isinf(n).any() and not torch.isinf(r).any():
        return "Inf where the reference is finite (overflow?)"
    if n.is_floating_point() and r.is_floating_point():
        scale = float(r.abs().max()) if r.numel() else 0.0
        big = n.abs() > max(1e6, 1e3 * scale)
        if big.any():
            return "garbage: values far outside the reference's range (uninitialised memory, or a wrong index?)"
        if bool((n == 0).all()) and bool((r != 0).any()):
            return "all zeros in this chunk where the reference is not (output never written?)"
    return "wrong values"


# How many elements of an expected output estimate its typical magnitude (see typical_magnitude).
MAGNITUDE_SAMPLE = 1 << 16


def typical_magnitude(r: torch.Tensor) -> float:
    """The 90th percentile of |want| over the finite elements of an expected output (a fixed
    pseudo-random sample of MAGNITUDE_SAMPLE elements where it is larger; 0 for integer outputs
    and where nothing is finite). The relative tolerance applies to the larger of an element's
    own magnitude and this one: an output near zero where long sums cancel (a matvec row, a
    matmul entry) carries the rounding of the sums that made it, which scales with the output's
    typical size, not with its own. A correct float32 matvec over 16384 terms summed in another
    order than the reference's missed the elementwise bound at 5 of 98304 outputs near zero
    (an error of 2.8e-4 where 1e-4 was allowed; the row sums' typical size is about 128). A
    percentile rather than the largest value or the RMS: a few huge outputs do not loosen the
    bound for the rest."""
    if not (r.is_floating_point() or r.is_complex()) or r.numel() == 0:
        return 0.0
    flat = r.reshape(-1)
    if flat.numel() > MAGNITUDE_SAMPLE:
        g = torch.Generator(device=flat.device).manual_seed(0x5EED)
        idx = torch.randint(0, flat.numel(), (MAGNITUDE_SAMPLE,), generator=g, device=flat.device)
        flat = flat[idx]
    mag = flat.abs().to(torch.float64)
    mag = mag[torch.isfinite(mag)]
    if mag.numel() == 0:
        return 0.0
    return float(torch.quantile(mag, 0.9))


def _close_fast(rc: torch.Tensor, nc: torch.Tensor, atol: float, rtol: float, floor: float = 0.0) -> tuple[float, float] | None:
    """(max abs error, max rel error) of a floating-point chunk that is within tolerance
    everywhere with room to spare, computed in the output's own precision (float32 for the
    16-bit types); None where anything needs a closer look (a non-finite difference, an
    element near or past the tolerance), which the exact float64 path then decides. A few
    passes over the chunk instead of a dozen over float64 copies: the common case of a check
    (a correct output) costs a fraction of the exact path."""
    work = torch.float64 if rc.dtype == torch.float64 else torch.float32
    rw = rc.to(work)
    diff = nc.to(work) - rw  # a new tensor: nothing the caller holds is written
    diff.abs_()
    worst = float(diff.max())  # NaN anywhere makes this NaN, an overflow makes it Inf
    if not math.isfinite(worst):
        return None
    ref_abs = rw.abs()
    # Rounding in float32 moves a difference or a bound by a few parts in 1e8: an element
    # within one part in 1e6 of its bound is left to the exact path.
    margin = 1.0 - 1e-6
    if not bool((diff <= ref_abs.clamp_min(floor).mul_(rtol * margin).add_(atol * margin)).all()):
        return None
    rel = float(diff.div_(ref_abs.clamp_min_(1e-12)).max())
    return worst, rel


def compare_tensor(i: int, r: torch.Tensor, n: torch.Tensor, atol=None, rtol=None, scale: float = 1.0) -> dict:
    """Compares one output with its reference; raises RuleBreak with where and how it is wrong.
    An element is right when |got - want| <= atol + rtol * max(|want|, m) in float64 (complex128
    for complex outputs; m is the output's typical magnitude, see typical_magnitude), when both
    are NaN, or when both are the same infinity: an infinite reference is matched only by itself
    (a finite value is never "within tolerance" of it). `scale` multiplies both tolerances
    (after the dtype's defaults are applied)."""
    if tuple(n.shape) != tuple(r.shape):
        raise RuleBreak("wrong_output", f"output {i}: shape {tuple(n.shape)} != expected {tuple(r.shape)}")
    if n.dtype != r.dtype:
        raise RuleBreak("precision", f"output {i}: dtype {n.dtype} != expected {r.dtype}")
    a, rt = TOLERANCE.get(r.dtype, (0.0, 0.0))
    a = (atol if atol is not None else a) * scale
    rt = (rtol if rtol is not None else rt) * scale
    rf, nf = r.reshape(-1), n.reshape(-1)
    total = rf.numel()
    floor = typical_magnitude(r)
    bad_count, first_bad, max_abs, max_rel, kind = 0, None, 0.0, 0.0, None
    for start in range(0, total, CHUNK):
        rc, nc = rf[start: start + CHUNK], nf[start: start + CHUNK]
        if r.is_floating_point():
            fast = _close_fast(rc, nc, a, rt, floor)
            if fast is not None:
                max_abs, max_rel = max(max_abs, fast[0]), max(max_rel, fast[1])
                continue
        if r.is_floating_point() or r.is_complex():
            wide = torch.complex128 if r.is_complex() else torch.float64
            rd, nd = rc.to(wide), nc.to(wide)
            diff = (nd - rd).abs()
            both_nan = torch.isnan(rd) & torch.isnan(nd)
            same_inf = torch.isinf(rd) & (rd == nd)
            finite = torch.isfinite(diff)
            ok = ((diff <= a + rt * rd.abs().clamp_min(floor)) & finite) | both_nan | same_inf
            if finite.any():
                max_abs = max(max_abs, float(diff[finite].max()))
                max_rel = max(max_rel, float((diff[finite] / rd.abs()[finite].clamp_min(1e-12)).max()))
        else:
            ok = rc == nc
        bad = ~ok
        nbad = int(bad.sum())
        if nbad:
            if first_bad is None:
                j = int(bad.nonzero()[0])
                first_bad = (start + j, rc[j].item(), nc[j].item())
                kind = _classify(nc, rc)
            bad_count += nbad
    if bad_count:
        idx, want, got = first_bad
        where = tuple(int(v) for v in torch.unravel_index(torch.tensor(idx), tuple(r.shape))) if r.dim() else ()
        raise RuleBreak(
            "wrong_output",
            f"output {i}: {bad_count} of {total} elements ({100.0 * bad_count / total:.3g}%) outside atol {a}, rtol {rt} (of max(|want|, {floor:.3g})): "
            f"{kind}; first at index {list(where)}: expected {_show(want)}, got {_show(got)}; max abs error {max_abs:.3g}",
        )
    return {"max_abs_error": max_abs, "max_rel_error": min(max_rel, 1e30),
            "bound": {"dtype": dtype_name(r.dtype), "atol": a, "rtol": rt, "typical_magnitude": floor}}


def _show(v) -> str:
    return f"{v:.6g}" if isinstance(v, (int, float)) else str(v)


_WEIGHTS: dict = {}


def all_finite(t: torch.Tensor) -> bool:
    """Whether every element is finite, chunk by chunk (no full-size temporary)."""
    if not (t.is_floating_point() or t.is_complex()):
        return True
    flat = t.reshape(-1)
    return all(bool(torch.isfinite(flat[i: i + CHUNK]).all()) for i in range(0, flat.numel(), CHUNK))


def checksum(t: torch.Tensor) -> int:
    """A position-weighted fingerprint of a uint8 region, to notice writes made after a reply
    (a plain sum would miss values moved around). Chunked: no full-size temporaries."""
    t = t.reshape(-1)
    # Whole 4-byte words where the memory is aligned for them; single bytes otherwise.
    if t.data_ptr() % 4 == 0:
        n = t.numel() // 4 * 4
        words, rest = t[:n].view(torch.int32), t[n:]
    else:
        words, rest = t, t[:0]
    chunk = 1 << 22
    w = _WEIGHTS.get(t.device)
    if w is None:
        w = _WEIGHTS[t.device] = torch.arange(1, chunk + 1, device=t.device, dtype=torch.int64) % 65521 + 1
    total = int(rest.to(torch.int64).sum()) if rest.numel() else 0
    for start in range(0, words.numel(), chunk):
        part = words[start: start + chunk].to(torch.int64)
        total = (total * 31 + int((part * w[: part.numel()]).sum())) & ((1 << 62) - 1)
    return total


def peak_rss_bytes(pid: int) -> int | None:
    """A process's peak resident memory (VmHWM), when /proc shows it."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def environment(device) -> dict:
    env = {"torch": torch.__version__, "device": str(device), "python": sys.version.split()[0], "flags": dict(PINNED_FLAGS)}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
    return env


# Peak DRAM bandwidth by device name, bytes/s, for the physical-floor check.
PEAK_BANDWIDTH = {"H200": 4.8e12, "H100 80GB HBM3": 3.35e12, "H100 PCIe": 2.0e12, "A100-SXM4-80GB": 2.04e12, "A100-SXM4-40GB": 1.56e12}


def physical_floor_ms(nbytes: int, device):
    """The least time any kernel needs to read the inputs and write the outputs once."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    bw = next((v for k, v in PEAK_BANDWIDTH.items() if k in name), None)
    return None if bw is None else nbytes / bw * 1e3


def geometric_mean(xs):
    xs = [x for x in xs if x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def cuda_ipc_selftest() -> str | None:
    """Whether a second process can map this one's device memory by IPC handle, as the judge
    and its workers do: None when it can, else what went wrong. Some virtualised GPUs cannot
    (the handle does not open), and then no CUDA evaluation can run."""
    import subprocess

    device = torch.device("cuda")
    region = CudaRegion.create(1 << 20, device)
    try:
        region.tensor[:16].view(torch.float32).copy_(torch.arange(4.0, device=device))
        torch.cuda.synchronize()
        code = (f"import sys; sys.path.append({str(Path(__file__).resolve().parent)!r}); import torch, cuda_agent_harness as h; "
                f"r = h.CudaRegion.open_peer({region.handle!r}, {region.nbytes}, torch.device('cuda')); "
                "print(float(r.tensor[:16].view(torch.float32).sum().item()))")
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    finally:
        region.close()
    if p.returncode != 0:
        lines = p.stderr.strip().splitlines()
        return lines[-1] if lines else f"the peer exited with status {p.returncode}"
    if p.stdout.strip() != "6.0":
        return f"the peer read {p.stdout.strip()!r} where 6.0 was written"
    return None

