"""A hand-written CUDA candidate for L1/32_MatVec: one warp per row, a shuffle reduction.
Used to measure the judge's peak GPU memory on the largest bundled tasks."""
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

CUDA = r"""
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
__global__ void matvec(const float* __restrict__ a, const float* __restrict__ v, float* __restrict__ y, int64_t m, int64_t k) {
    int64_t row = blockIdx.x * (int64_t)(blockDim.x / 32) + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (row >= m) return;
    const float* r = a + row * k;
    float s = 0.f;
    for (int64_t j = lane; j < k; j += 32) s += r[j] * v[j];
    for (int o = 16; o > 0; o /= 2) s += __shfl_down_sync(0xffffffff, s, o);
    if (lane == 0) y[row] = s;
}
torch::Tensor run(torch::Tensor a, torch::Tensor v) {
    int64_t m = a.size(0), k = a.size(1);
    auto y = torch::empty({m}, a.options());
    if (m > 0) matvec<<<(m + 7) / 8, 256, 0, at::cuda::getCurrentCUDAStream()>>>(a.data_ptr<float>(), v.data_ptr<float>(), y.data_ptr<float>(), m, k);
    return y;
}
"""
ext = load_inline(name="mem_matvec_cuda", cpp_sources="torch::Tensor run(torch::Tensor a, torch::Tensor v);", cuda_sources=CUDA,
                  functions=["run"], extra_cuda_cflags=["-O3"])


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, a, v):
        return ext.run(a.contiguous(), v.contiguous())
