"""CPU time of building one small C++ kernel, each build in a fresh extensions directory: with
torch's headers (`load_inline(functions=...)`, what most candidates write; precompiled ones are
used where CPATH provides them, as env-server sets it) and with pybind11 alone (raw pointers,
`no_implicit_headers=True`; SKILL.md's fast path), beside importing torch alone. Prints a
Markdown table.

    python scripts/bench_build_paths.py [--repeat 2]

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


def run(code: str) -> tuple[float, float]:
    """(wall s, user+sys CPU s of the child and its compilers)."""
    with tempfile.TemporaryDirectory() as d:
        env = dict(os.environ, TORCH_EXTENSIONS_DIR=d)
        env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True)
        wall = time.perf_counter() - t
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=2)
    args = p.parse_args()
    rows = [("import torch (no build)", IMPORT), ("torch headers (load_inline, functions=)", TORCH), ("pybind11 only (no_implicit_headers)", PYBIND)]
    print(f"CPATH={os.environ.get('CPATH', '')!r}\n")
    print("| build | wall s (best) | CPU s (best) |")
    print("| --- | ---: | ---: |")
    for name, code in rows:
        runs = [run(code) for _ in range(args.repeat)]
        print(f"| {name} | {min(r[0] for r in runs):.1f} | {min(r[1] for r in runs):.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
