"""A hand-written CUDA candidate for L2/2_Scale_Add_Tanh: the whole chain in one kernel."""
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

CUDA = r"""
#include <torch/extension.h>
__global__ void fused(const float* __restrict__ x, const float* __restrict__ bias, float* __restrict__ o, float scale, int64_t n, int64_t dim) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        o[i] = tanhf(x[i] * scale + bias[i % dim]) * 0.5f;
    }
}
torch::Tensor run(torch::Tensor x, torch::Tensor bias, double scale) {
    auto out = torch::empty_like(x);
    fused<<<2112, 256>>>(x.data_ptr<float>(), bias.data_ptr<float>(), out.data_ptr<float>(), (float)scale, x.numel(), bias.numel());
    return out;
}
"""
ext = load_inline(name="ex_sat_cuda", cpp_sources="torch::Tensor run(torch::Tensor x, torch::Tensor bias, double scale);", cuda_sources=CUDA, functions=["run"], extra_cuda_cflags=["-O3"])


class ModelNew(nn.Module):
    def __init__(self, scale):
        super().__init__()
        self.scale = scale
        self.bias = nn.Parameter(torch.randn(16384))

    def forward(self, x):
        return ext.run(x.contiguous(), self.bias, self.scale)
