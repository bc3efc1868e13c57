"""A hand-written CUDA candidate for L1/7_Sigmoid: one elementwise kernel (1 / (1 + e^-x)), grid-stride
loop. Used to measure the judge's peak GPU memory on the largest bundled tasks."""
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

CUDA = r"""
#include <torch/extension.h>
__device__ __forceinline__ float op(float v) { return 1.f / (1.f + expf(-v)); }
__global__ void unary(const float* __restrict__ x, float* __restrict__ y, int64_t n) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        y[i] = op(x[i]);
}
torch::Tensor run(torch::Tensor x) {
    auto y = torch::empty_like(x);
    int64_t n = x.numel();
    if (n > 0) unary<<<2112, 512, 0, at::cuda::getCurrentCUDAStream()>>>(x.data_ptr<float>(), y.data_ptr<float>(), n);
    return y;
}
"""
ext = load_inline(name="mem_sigmoid_cuda", cpp_sources="torch::Tensor run(torch::Tensor x);", cuda_sources="#include <ATen/cuda/CUDAContext.h>\n" + CUDA,
                  functions=["run"], extra_cuda_cflags=["-O3"])


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        return ext.run(x.contiguous())
