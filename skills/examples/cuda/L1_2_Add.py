"""A hand-written CUDA candidate for L1/2_Add: a vectorised (float4) elementwise add."""
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

CUDA = r"""
#include <torch/extension.h>
__global__ void add4(const float4* __restrict__ a, const float4* __restrict__ b, float4* __restrict__ o, int64_t n4) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n4; i += (int64_t)gridDim.x * blockDim.x) {
        float4 x = a[i], y = b[i];
        o[i] = make_float4(x.x + y.x, x.y + y.y, x.z + y.z, x.w + y.w);
    }
}
__global__ void add1(const float* a, const float* b, float* o, int64_t start, int64_t n) {
    int64_t i = start + blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (i < n) o[i] = a[i] + b[i];
}
torch::Tensor add(torch::Tensor a, torch::Tensor b) {
    auto out = torch::empty_like(a);
    int64_t n = a.numel(), n4 = n / 4;
    if (n4 > 0) add4<<<1056, 512>>>((const float4*)a.data_ptr<float>(), (const float4*)b.data_ptr<float>(), (float4*)out.data_ptr<float>(), n4);
    if (n % 4) add1<<<1, 4>>>(a.data_ptr<float>(), b.data_ptr<float>(), out.data_ptr<float>(), n4 * 4, n);
    return out;
}
"""
ext = load_inline(name="ex_add_cuda", cpp_sources="torch::Tensor add(torch::Tensor a, torch::Tensor b);", cuda_sources=CUDA, functions=["add"], extra_cuda_cflags=["-O3"])


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, a, b):
        return ext.add(a.contiguous(), b.contiguous())
