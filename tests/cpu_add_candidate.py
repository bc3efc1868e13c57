import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

# The kernel in plain C++ bound with pybind11 alone (the fast path SKILL.md describes): its
# build takes a few seconds of one core, where one that includes <torch/extension.h> parses
# the torch headers for 15-25 s. cpu_add_candidate_torch_headers.py is the same add with them.
SRC = r"""
#include <cstdint>
#include <pybind11/pybind11.h>
static void add(std::uintptr_t a, std::uintptr_t b, std::uintptr_t out, std::int64_t n) {
    const float* pa = reinterpret_cast<const float*>(a);
    const float* pb = reinterpret_cast<const float*>(b);
    float* po = reinterpret_cast<float*>(out);
    for (std::int64_t i = 0; i < n; ++i) po[i] = pa[i] + pb[i];
}
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("add", &add); }
"""
ext = load_inline(name="e2e_add", cpp_sources=SRC, no_implicit_headers=True, extra_cflags=["-O3"])


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, a, b):
        a, b = a.contiguous(), b.contiguous()
        if a.dtype != torch.float32 or b.dtype != torch.float32 or a.shape != b.shape:
            raise ValueError("two float32 tensors of one shape expected")
        out = torch.empty_like(a)
        ext.add(a.data_ptr(), b.data_ptr(), out.data_ptr(), a.numel())
        return out
