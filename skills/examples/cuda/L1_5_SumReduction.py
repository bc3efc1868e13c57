"""A hand-written CUDA candidate for L1/5_SumReduction (rows of a 2-D tensor, dim=1): one
block per row, strided per-thread sums, warp shuffles, one shared-memory step."""
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

CUDA = r"""
#include <torch/extension.h>
__global__ void row_sum(const float* __restrict__ x, float* __restrict__ y, int64_t cols) {
    const float* xr = x + blockIdx.x * cols;
    float s = 0.f;
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) s += xr[c];
    for (int off = 16; off > 0; off >>= 1) s += __shfl_down_sync(0xffffffff, s, off);
    __shared__ float warp_sums[32];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) warp_sums[warp] = s;
    __syncthreads();
    if (warp == 0) {
        s = lane < (blockDim.x >> 5) ? warp_sums[lane] : 0.f;
        for (int off = 16; off > 0; off >>= 1) s += __shfl_down_sync(0xffffffff, s, off);
        if (lane == 0) y[blockIdx.x] = s;
    }
}
torch::Tensor sum_rows(torch::Tensor x) {
    TORCH_CHECK(x.dim() == 2, "expects a 2-D tensor");
    auto y = torch::empty({x.size(0), 1}, x.options());
    row_sum<<<x.size(0), 512>>>(x.data_ptr<float>(), y.data_ptr<float>(), x.size(1));
    return y;
}
"""
ext = load_inline(name="ex_sum_rows_cuda", cpp_sources="torch::Tensor sum_rows(torch::Tensor x);", cuda_sources=CUDA, functions=["sum_rows"], extra_cuda_cflags=["-O3"])


class ModelNew(nn.Module):
    def __init__(self, dim):
        super().__init__()
        if dim not in (1, -1):
            raise ValueError("this kernel sums over the last dimension of a 2-D tensor")

    def forward(self, x):
        return ext.sum_rows(x.contiguous())
