"""CPU time of building one small C++ kernel, each build in a fresh extensions directory: with
torch's headers (`load_inline(functions=...)`, what most candidates write; precompiled ones are
used where CPATH provides them, as env-server sets it) and with pybind11 alone (raw pointers,
`no_implicit_headers=True`; SKILL.md's fast path), beside importing torch alone. Prints a
Markdown table.

    python scripts/bench_build_paths.py [--repeat 2] [--cuda]

User+sys CPU time is reported beside wall time: on a shared machine the wall time says more
about the neighbours than about the build.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time

TORCH = r'''
from torch.utils.cpp_extension import load_inline
SRC = """
torch::Tensor add(torch::Tensor a, torch::Tensor b) {
    auto out = torch::empty_like(a);
    const float* pa = a.data_ptr<float>(); const float* pb = b.data_ptr<float>(); float* po = out.data_ptr<float>();
    for (int64_t i = 0; i < a.numel(); ++i) po[i] = pa[i] + pb[i];
    return out;
}
"""
load_inline(name="bench_torch", cpp_sources=SRC, functions=["add"], extra_cflags=["-O3"])
'''

PYBIND = r'''
from torch.utils.cpp_extension import load_inline
SRC = """
#include <cstdint>
#include <pybind11/pybind11.h>
static void add(std::uintptr_t a, std::uintptr_t b, std::uintptr_t o, std::int64_t n) {
    auto pa = reinterpret_cast<const float*>(a), pb = reinterpret_cast<const float*>(b);
    auto po = reinterpret_cast<float*>(o);
    for (std::int64_t i = 0; i < n; ++i) po[i] = pa[i] + pb[i];
}
PYBIND11_MODULE(bench_pybind, m) { m.def("add", &add); }
"""
load_inline(name="bench_pybind", cpp_sources=SRC, no_implicit_headers=True, extra_cflags=["-O3"])
'''

IMPORT = "import torch\nimport torch.utils.cpp_extension\n"

# A CUDA kernel in a .cu without torch headers (nvcc for the exact architecture, as the server
# sets TORCH_CUDA_ARCH_LIST), bound by pybind11 alone in the C++ half.
CUDA_PLAIN = r'''
import torch
from torch.utils.cpp_extension import load_inline
CU = """
#include <cstdint>
#include <cuda_runtime.h>
__global__ void add_k(const float* a, const float* b, float* o, std::int64_t n) {
    std::int64_t i = blockIdx.x * (std::int64_t)blockDim.x + threadIdx.x;
    if (i < n) o[i] = a[i] + b[i];
}
void add_launch(const float* a, const float* b, float* o, std::int64_t n) {
    add_k<<<(unsigned)((n + 255) / 256), 256>>>(a, b, o, n);
}
"""
CPP = """
#include <cstdint>
#include <pybind11/pybind11.h>
void add_launch(const float* a, const float* b, float* o, std::int64_t n);
static void add(std::uintptr_t a, std::uintptr_t b, std::uintptr_t o, std::int64_t n) {
    add_launch(reinterpret_cast<const float*>(a), reinterpret_cast<const float*>(b), reinterpret_cast<float*>(o), n);
}
PYBIND11_MODULE(bench_cuda_plain, m) { m.def("add", &add); }
"""
load_inline(name="bench_cuda_plain", cpp_sources=CPP, cuda_sources=CU, no_implicit_headers=True, extra_cuda_cflags=["-O3"])
'''

# The same kernel compiled at run time by NVRTC (no build step); prints the compile's own time.
NVRTC = r'''
import time, torch
torch.cuda.init()
SRC = """
extern "C" __global__ void add_k(const float* a, const float* b, float* o, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) o[i] = a[i] + b[i];
}
"""
t = time.perf_counter()
k = torch.cuda._compile_kernel(SRC, "add_k")
first = time.perf_counter() - t
t = time.perf_counter()
torch.cuda._compile_kernel(SRC.replace("a[i] + b[i]", "b[i] + a[i]"), "add_k")
print(f"nvrtc_s {first:.3f} {time.perf_counter() - t:.3f}")
'''


def run(code: str) -> tuple[float, float]:
    """(wall s, user+sys CPU s of the child and its compilers); what the child prints is shown."""
    with tempfile.TemporaryDirectory() as d:
        env = dict(os.environ, TORCH_EXTENSIONS_DIR=d)
        env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t = time.perf_counter()
        out = subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True)
        wall = time.perf_counter() - t
        for line in out.stdout.splitlines():
            if line.startswith("nvrtc_s"):
                first, again = line.split()[1:]
                print(f"  NVRTC compile in process: first {first} s, a changed kernel {again} s", file=sys.stderr)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--cuda", action="store_true", help="also a CUDA kernel without torch headers (nvcc) and the same kernel by NVRTC")
    args = p.parse_args()
    rows = [("import torch (no build)", IMPORT), ("torch headers (load_inline, functions=)", TORCH), ("pybind11 only (no_implicit_headers)", PYBIND)]
    if args.cuda:
        import torch

        major, minor = torch.cuda.get_device_capability()
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", f"{major}.{minor}")
        rows += [("CUDA .cu without torch headers (nvcc, pybind11 binding)", CUDA_PLAIN), ("NVRTC (torch.cuda._compile_kernel; import included)", NVRTC)]
    print(f"CPATH={os.environ.get('CPATH', '')!r}\n")
    print("| build | wall s (best) | CPU s (best) |")
    print("| --- | ---: | ---: |")
    for name, code in rows:
        runs = [run(code) for _ in range(args.repeat)]
        print(f"| {name} | {min(r[0] for r in runs):.1f} | {min(r[1] for r in runs):.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
