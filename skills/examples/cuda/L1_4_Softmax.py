"""A deliberately naive CUDA candidate for L1/4_Softmax: one thread per row, three passes
over it. Correct, and much slower than PyTorch (the benchmark's slow example)."""
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

CUDA = r"""
#include <torch/extension.h>
__global__ void softmax_rows(const float* __restrict__ x, float* __restrict__ y, int64_t rows, int64_t cols) {
    int64_t r = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (r >= rows) return;
    const float* xr = x + r * cols;
    float* yr = y + r * cols;
    float m = -INFINITY;
    for (int64_t c = 0; c < cols; ++c) m = fmaxf(m, xr[c]);
    float s = 0.f;
    for (int64_t c = 0; c < cols; ++c) s += expf(xr[c] - m);
    float inv = 1.f / s;
    for (int64_t c = 0; c < cols; ++c) yr[c] = expf(xr[c] - m) * inv;
}
torch::Tensor softmax(torch::Tensor x) {
    auto y = torch::empty_like(x);
    int64_t cols = x.size(-1), rows = x.numel() / cols;
    softmax_rows<<<(rows + 127) / 128, 128>>>(x.data_ptr<float>(), y.data_ptr<float>(), rows, cols);
    return y;
}
"""
ext = load_inline(name="ex_softmax_naive_cuda", cpp_sources="torch::Tensor softmax(torch::Tensor x);", cuda_sources=CUDA, functions=["softmax"], extra_cuda_cflags=["-O3"])


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        return ext.softmax(x.contiguous())
