"""A hand-written CUDA candidate for L1/16_LogSoftmax: one pass over memory. A block owns a
row and keeps all of it in registers (1024 threads x 8 float4 = 32768 floats), so the row is
read from DRAM once and written once; PyTorch's kernels (eager and compiled) walk each row
more than once. The max and the sum of exponentials are block reductions (warp shuffles, then
one warp over the per-warp partials)."""
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

CUDA = r"""
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>

template <bool MAX>
__device__ __forceinline__ float block_reduce(float v, float* scratch) {
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        float w = __shfl_xor_sync(0xffffffffu, v, o);
        v = MAX ? fmaxf(v, w) : v + w;
    }
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < warps ? scratch[lane] : (MAX ? -INFINITY : 0.f);
        #pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            float w = __shfl_xor_sync(0xffffffffu, v, o);
            v = MAX ? fmaxf(v, w) : v + w;
        }
        if (lane == 0) scratch[32] = v;
    }
    __syncthreads();
    float r = scratch[32];
    __syncthreads();  // scratch is reused by the next reduction
    return r;
}

// NV float4 per thread; blockDim.x * NV * 4 >= cols.
template <int NV>
__global__ void __launch_bounds__(1024) log_softmax_rows(const float4* __restrict__ x, float4* __restrict__ y, int cols4) {
    __shared__ float scratch[33];
    const float4* xr = x + (int64_t)blockIdx.x * cols4;
    float4* yr = y + (int64_t)blockIdx.x * cols4;
    float4 v[NV];
    #pragma unroll
    for (int i = 0; i < NV; ++i) {
        int c = threadIdx.x + i * blockDim.x;
        v[i] = c < cols4 ? __ldcs(xr + c) : make_float4(-INFINITY, -INFINITY, -INFINITY, -INFINITY);
    }
    float m = -INFINITY;
    #pragma unroll
    for (int i = 0; i < NV; ++i) m = fmaxf(m, fmaxf(fmaxf(v[i].x, v[i].y), fmaxf(v[i].z, v[i].w)));
    m = block_reduce<true>(m, scratch);
    float s = 0.f;
    #pragma unroll
    for (int i = 0; i < NV; ++i) s += expf(v[i].x - m) + expf(v[i].y - m) + expf(v[i].z - m) + expf(v[i].w - m);
    s = block_reduce<false>(s, scratch);
    float lse = m + logf(s);
    #pragma unroll
    for (int i = 0; i < NV; ++i) {
        int c = threadIdx.x + i * blockDim.x;
        if (c < cols4) __stcs(yr + c, make_float4(v[i].x - lse, v[i].y - lse, v[i].z - lse, v[i].w - lse));
    }
}

// Any row length: three passes over the row (the later ones mostly from L2).
__global__ void log_softmax_rows_any(const float* __restrict__ x, float* __restrict__ y, int64_t cols) {
    __shared__ float scratch[33];
    const float* xr = x + (int64_t)blockIdx.x * cols;
    float* yr = y + (int64_t)blockIdx.x * cols;
    float m = -INFINITY;
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) m = fmaxf(m, xr[c]);
    m = block_reduce<true>(m, scratch);
    float s = 0.f;
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) s += expf(xr[c] - m);
    s = block_reduce<false>(s, scratch);
    float lse = m + logf(s);
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) yr[c] = xr[c] - lse;
}

torch::Tensor log_softmax(torch::Tensor x) {
    TORCH_CHECK(x.is_cuda() && x.scalar_type() == torch::kFloat && x.is_contiguous(), "x: contiguous float32 on CUDA");
    auto y = torch::empty_like(x);
    int64_t cols = x.size(-1), rows = x.numel() / cols;
    auto stream = c10::cuda::getCurrentCUDAStream();
    const float4* x4 = reinterpret_cast<const float4*>(x.data_ptr<float>());
    float4* y4 = reinterpret_cast<float4*>(y.data_ptr<float>());
    bool aligned = reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0 && reinterpret_cast<uintptr_t>(y.data_ptr()) % 16 == 0;
    int cols4 = (int)(cols / 4);
    if (cols % 4 == 0 && aligned && cols4 <= 1024 * 8) {
        // The fewest float4 per thread that fit the row in 1024 threads, then just enough warps.
        int nv = cols4 <= 1024 ? 1 : cols4 <= 2048 ? 2 : cols4 <= 4096 ? 4 : 8;
        int threads = ((cols4 + nv - 1) / nv + 31) / 32 * 32;
        switch (nv) {
            case 1: log_softmax_rows<1><<<rows, threads, 0, stream>>>(x4, y4, cols4); break;
            case 2: log_softmax_rows<2><<<rows, threads, 0, stream>>>(x4, y4, cols4); break;
            case 4: log_softmax_rows<4><<<rows, threads, 0, stream>>>(x4, y4, cols4); break;
            default: log_softmax_rows<8><<<rows, threads, 0, stream>>>(x4, y4, cols4); break;
        }
    } else {
        log_softmax_rows_any<<<rows, 512, 0, stream>>>(x.data_ptr<float>(), y.data_ptr<float>(), cols);
    }
    return y;
}
"""
ext = load_inline(name="ex_log_softmax_cuda", cpp_sources="torch::Tensor log_softmax(torch::Tensor x);", cuda_sources=CUDA, functions=["log_softmax"], extra_cuda_cflags=["-O3"])


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        return ext.log_softmax(x.contiguous())
