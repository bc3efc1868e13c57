"""What one iteration of the agent's loop costs in its workspace: verify.py after the first
build, again on unchanged sources, after a one-line change to one kernel file, then
profile.py against eager and against eager and torch.compile (twice: the second reuses
torch.compile's caches in the workspace's TMPDIR). Runs the workspace's own
scripts as the agent would (a fresh workspace per layout, the episode's environment: its own
TMPDIR and extensions directory, the small task size on CPU), with every skills folder given
(`--before DIR` for an older one), and prints a Markdown table of wall seconds per step.

    python scripts/bench_agent_loop.py --device cpu
    python scripts/bench_agent_loop.py --device cpu --before /tmp/old/skills --layouts inline split
    python scripts/bench_agent_loop.py --device cuda --layouts inline split

Layouts (the add task, kernelbench/tasks/level1/2_Add.py):
  inline  `load_inline` with torch headers in model_new.py (the KernelBench layout)
  split   kernels/binding.cpp (torch headers, the Python binding) + kernels/add.{cpp,cu}
          (the kernel alone, raw pointers, no torch headers): the layout that makes a
          one-kernel change cheap
  pybind  kernels/add.cpp bound with pybind11 alone, raw pointers from Python (CPU only)
The edit rewrites one line of the kernel's source (a marker comment: the compiler does the
same work as for a real change).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TASK = ROOT / "kernelbench" / "tasks" / "level1" / "2_Add.py"

CPU_KERNEL = """#include <cstdint>
// edit: 0
void add_kernel(const float* a, const float* b, float* out, std::int64_t n) {
    for (std::int64_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
}
"""

CUDA_KERNEL = """#include <cstdint>
#include <cuda_runtime.h>
// edit: 0
__global__ void add_k(const float* __restrict__ a, const float* __restrict__ b, float* __restrict__ out, std::int64_t n) {
    for (std::int64_t i = blockIdx.x * (std::int64_t)blockDim.x + threadIdx.x; i < n; i += (std::int64_t)gridDim.x * blockDim.x)
        out[i] = a[i] + b[i];
}
void add_kernel(const float* a, const float* b, float* out, std::int64_t n, cudaStream_t stream) {
    int blocks = (int)((n + 255) / 256 < 4096 ? (n + 255) / 256 : 4096);
    add_k<<<blocks, 256, 0, stream>>>(a, b, out, n);
}
"""

CPU_BINDING = """#include <torch/extension.h>
void add_kernel(const float* a, const float* b, float* out, std::int64_t n);
torch::Tensor add(torch::Tensor a, torch::Tensor b) {
    TORCH_CHECK(a.is_contiguous() && b.is_contiguous() && a.scalar_type() == torch::kFloat32 && a.sizes() == b.sizes(), "float32 contiguous inputs of one shape");
    auto out = torch::empty_like(a);
    add_kernel(a.data_ptr<float>(), b.data_ptr<float>(), out.data_ptr<float>(), a.numel());
    return out;
}
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("add", &add); }
"""

CUDA_BINDING = """#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
void add_kernel(const float* a, const float* b, float* out, std::int64_t n, cudaStream_t stream);
torch::Tensor add(torch::Tensor a, torch::Tensor b) {
    TORCH_CHECK(a.is_cuda() && a.is_contiguous() && b.is_contiguous() && a.scalar_type() == torch::kFloat32 && a.sizes() == b.sizes(), "float32 contiguous CUDA inputs of one shape");
    auto out = torch::empty_like(a);
    add_kernel(a.data_ptr<float>(), b.data_ptr<float>(), out.data_ptr<float>(), a.numel(), at::cuda::getCurrentCUDAStream());
    return out;
}
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("add", &add); }
"""

KERNELS_MODEL_NEW = """import torch
import torch.nn as nn
import kernels_ext


class ModelNew(nn.Module):
    def forward(self, a, b):
        return kernels_ext.add(a.contiguous(), b.contiguous())
"""

PYBIND_KERNEL = """#include <cstdint>
#include <pybind11/pybind11.h>
// edit: 0
static void add(std::uintptr_t a, std::uintptr_t b, std::uintptr_t out, std::int64_t n) {
    auto pa = reinterpret_cast<const float*>(a), pb = reinterpret_cast<const float*>(b);
    auto po = reinterpret_cast<float*>(out);
    for (std::int64_t i = 0; i < n; ++i) po[i] = pa[i] + pb[i];
}
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("add", &add); }
"""

PYBIND_MODEL_NEW = """import torch
import torch.nn as nn
import kernels_ext


class ModelNew(nn.Module):
    def forward(self, a, b):
        a, b = a.contiguous(), b.contiguous()
        assert a.dtype == b.dtype == torch.float32 and a.shape == b.shape and a.device.type == "cpu"
        out = torch.empty_like(a)
        kernels_ext.add(a.data_ptr(), b.data_ptr(), out.data_ptr(), a.numel())
        return out
"""

INLINE_MODEL_NEW = '''import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

SRC = """
// edit: 0
torch::Tensor add(torch::Tensor a, torch::Tensor b) {
    TORCH_CHECK(a.is_contiguous() && b.is_contiguous() && a.sizes() == b.sizes(), "contiguous inputs of one shape");
    auto out = torch::empty_like(a);
    const float* pa = a.data_ptr<float>(); const float* pb = b.data_ptr<float>(); float* po = out.data_ptr<float>();
    for (int64_t i = 0; i < a.numel(); ++i) po[i] = pa[i] + pb[i];
    return out;
}
"""
ext = load_inline(name="bench_add_inline", cpp_sources=SRC, functions=["add"], extra_cflags=["-O3"])


class ModelNew(nn.Module):
    def forward(self, a, b):
        return ext.add(a.contiguous(), b.contiguous())
'''

INLINE_CUDA_MODEL_NEW = '''import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

CUDA = """
// edit: 0
__global__ void add_k(const float* __restrict__ a, const float* __restrict__ b, float* __restrict__ out, int64_t n) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        out[i] = a[i] + b[i];
}
torch::Tensor add(torch::Tensor a, torch::Tensor b) {
    TORCH_CHECK(a.is_cuda() && a.is_contiguous() && b.is_contiguous() && a.sizes() == b.sizes(), "contiguous CUDA inputs of one shape");
    auto out = torch::empty_like(a);
    int64_t n = a.numel();
    int blocks = (int)((n + 255) / 256 < 4096 ? (n + 255) / 256 : 4096);
    add_k<<<blocks, 256>>>(a.data_ptr<float>(), b.data_ptr<float>(), out.data_ptr<float>(), n);
    return out;
}
"""
ext = load_inline(name="bench_add_inline_cuda", cpp_sources="torch::Tensor add(torch::Tensor a, torch::Tensor b);",
                  cuda_sources=CUDA, functions=["add"], extra_cuda_cflags=["-O3"])


class ModelNew(nn.Module):
    def forward(self, a, b):
        return ext.add(a.contiguous(), b.contiguous())
'''


def layout_files(layout: str, device: str) -> tuple[dict[str, str], str]:
    """The workspace files of a layout, and the one the edit rewrites."""
    cuda = device == "cuda"
    if layout == "inline":
        return {"model_new.py": INLINE_CUDA_MODEL_NEW if cuda else INLINE_MODEL_NEW}, "model_new.py"
    if layout == "split":
        kernel = "kernels/add.cu" if cuda else "kernels/add.cpp"
        return {"model_new.py": KERNELS_MODEL_NEW, "kernels/binding.cpp": CUDA_BINDING if cuda else CPU_BINDING,
                kernel: CUDA_KERNEL if cuda else CPU_KERNEL}, kernel
    if layout == "pybind":
        if cuda:
            raise SystemExit("the pybind layout is a CPU one")
        return {"model_new.py": PYBIND_MODEL_NEW, "kernels/add.cpp": PYBIND_KERNEL}, "kernels/add.cpp"
    raise SystemExit(f"unknown layout {layout}")


def steps() -> list[tuple[str, list[str] | None]]:
    """(label, command; None is the one-line edit, timed with the command after it)."""
    return [
        ("verify.py, first build", ["verify.py"]),
        ("verify.py, unchanged sources", ["verify.py"]),
        ("one-line kernel change + verify.py", None),
        ("profile.py --compare eager", ["profile.py", "--compare", "eager"]),
        ("profile.py --compare eager compile", ["profile.py", "--compare", "eager", "compile"]),
        ("one-line kernel change + profile.py --compare eager", None),
        ("profile.py --compare eager compile, again", ["profile.py", "--compare", "eager", "compile"]),
    ]


def run_loop(skills: Path, layout: str, device: str, python: str, keep: bool) -> list[dict]:
    root = Path(tempfile.mkdtemp(prefix=f"agent-loop-{layout}-"))
    ws, tmp = root / "workspace", root / "tmp"
    ws.mkdir()
    tmp.mkdir()
    for f in skills.iterdir():
        if f.is_file() and f.suffix in (".py", ".md"):
            shutil.copy(f, ws / f.name)
    shutil.copy(TASK, ws / "model.py")
    files, edited = layout_files(layout, device)
    for name, text in files.items():
        (ws / name).parent.mkdir(parents=True, exist_ok=True)
        (ws / name).write_text(text)
    env = dict(os.environ, TMPDIR=str(tmp), TORCH_EXTENSIONS_DIR=str(tmp / "torch_extensions"), CUDA_AGENT_DEVICE=device,
               PYTHONUNBUFFERED="1", PATH=f"{Path(python).parent}:{os.environ.get('PATH', '')}")
    if device == "cpu":
        env["CUDA_AGENT_TASK_SIZE"] = "small"
    rows = []
    edits = 0
    for label, cmd in steps():
        t0 = time.perf_counter()
        if cmd is None:  # the edit, then the next step's command, timed together
            edits += 1
            p = ws / edited
            p.write_text(p.read_text().replace(f"// edit: {edits - 1}", f"// edit: {edits}"))
            cmd = ["verify.py"] if "verify" in label else ["profile.py", "--compare", "eager"]
        r = subprocess.run([python, *cmd], cwd=ws, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        ok = r.returncode == 0
        rows.append({"step": label, "wall_s": wall, "ok": ok})
        print(f"  {layout:<7} {label:<52} {wall:7.1f} s {'ok' if ok else 'FAILED'}", file=sys.stderr, flush=True)
        if not ok:
            print(r.stdout[-3000:] + r.stderr[-3000:], file=sys.stderr)
    if keep:
        print(f"  kept {root}", file=sys.stderr)
    else:
        shutil.rmtree(root, ignore_errors=True)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--skills", default=str(ROOT / "skills"), help="the skills folder measured (default: this checkout's)")
    p.add_argument("--before", help="an older skills folder, measured the same way first")
    p.add_argument("--layouts", nargs="*", default=None, help="inline, split, pybind (default: inline split, plus pybind on CPU)")
    p.add_argument("--python", default=os.environ.get("CUDA_AGENT_PYTHON", sys.executable))
    p.add_argument("--json", help="also write the rows here")
    p.add_argument("--keep", action="store_true", help="keep the workspaces")
    args = p.parse_args()
    layouts = args.layouts or (["inline", "split"] + (["pybind"] if args.device == "cpu" else []))
    sides = ([("before", Path(args.before))] if args.before else []) + [("after" if args.before else "seconds", Path(args.skills))]
    results: dict = {}
    for layout in layouts:
        for side, skills in sides:
            print(f"{side}: {skills}", file=sys.stderr)
            results[(layout, side)] = run_loop(skills, layout, args.device, args.python, args.keep)
    head = "| layout | step | " + " | ".join(f"{s} s" for s, _ in sides) + (" | after / before |" if args.before else " |")
    print(head)
    print("| --- | --- | " + " | ".join("---:" for _ in sides) + (" | ---: |" if args.before else " |"))
    for layout in layouts:
        for k, (label, _) in enumerate(steps()):
            cells = []
            for side, _ in sides:
                row = results[(layout, side)][k]
                cells.append(f"{row['wall_s']:.1f}" + ("" if row["ok"] else " (failed)"))
            ratio = ""
            if args.before:
                b, a = results[(layout, "before")][k]["wall_s"], results[(layout, "after")][k]["wall_s"]
                ratio = f" | {a / b:.2f}"
            print(f"| {layout} | {label} | " + " | ".join(cells) + ratio + " |")
    if args.json:
        Path(args.json).write_text(json.dumps({f"{layout}/{s}": rows for (layout, s), rows in results.items()}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
