"""A hand-written CUDA candidate for L2/2_Scale_Add_Tanh: the whole chain in one kernel, at
the memory roofline. Each thread owns four adjacent columns (one float4) of eight rows: the
bias is loaded once and reused, the index needs no division, and the eight loads are issued
before any arithmetic so enough bytes are in flight. Streaming loads and stores (`__ldcs`,
`__stcs`) keep the once-touched data from evicting anything useful from L2."""
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

CUDA = r"""
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>

constexpr int ROWS = 8;     // rows per thread
constexpr int THREADS = 256;

__device__ __forceinline__ float f(float x, float b, float scale) { return tanhf(x * scale + b) * 0.5f; }

__global__ void __launch_bounds__(THREADS) fused_vec4(const float4* __restrict__ x, const float4* __restrict__ bias,
                                                      float4* __restrict__ o, float scale, int rows, int cols4) {
    int c = blockIdx.x * THREADS + threadIdx.x;
    if (c >= cols4) return;
    int r0 = blockIdx.y * ROWS;
    float4 b = bias[c];
    float4 v[ROWS];
    #pragma unroll
    for (int k = 0; k < ROWS; ++k)
        if (r0 + k < rows) v[k] = __ldcs(x + (int64_t)(r0 + k) * cols4 + c);
    #pragma unroll
    for (int k = 0; k < ROWS; ++k) {
        if (r0 + k >= rows) break;
        float4 y = make_float4(f(v[k].x, b.x, scale), f(v[k].y, b.y, scale), f(v[k].z, b.z, scale), f(v[k].w, b.w, scale));
        __stcs(o + (int64_t)(r0 + k) * cols4 + c, y);
    }
}

// Any shape: one element per thread, grid-stride.
__global__ void fused_scalar(const float* __restrict__ x, const float* __restrict__ bias, float* __restrict__ o,
                             float scale, int64_t n, int64_t dim) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        o[i] = f(x[i], bias[i % dim], scale);
}

torch::Tensor run(torch::Tensor x, torch::Tensor bias, double scale) {
    TORCH_CHECK(x.is_cuda() && x.scalar_type() == torch::kFloat && x.is_contiguous(), "x: contiguous float32 on CUDA");
    auto out = torch::empty_like(x);
    int64_t dim = bias.numel(), rows = x.numel() / dim;
    auto stream = c10::cuda::getCurrentCUDAStream();
    bool aligned = reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0 && reinterpret_cast<uintptr_t>(out.data_ptr()) % 16 == 0
                   && reinterpret_cast<uintptr_t>(bias.data_ptr()) % 16 == 0;
    if (dim % 4 == 0 && aligned && rows < (1LL << 31) / ROWS) {
        int cols4 = (int)(dim / 4);
        dim3 grid((cols4 + THREADS - 1) / THREADS, (unsigned)((rows + ROWS - 1) / ROWS));
        fused_vec4<<<grid, THREADS, 0, stream>>>(reinterpret_cast<const float4*>(x.data_ptr<float>()),
            reinterpret_cast<const float4*>(bias.data_ptr<float>()), reinterpret_cast<float4*>(out.data_ptr<float>()),
            (float)scale, (int)rows, cols4);
    } else {
        fused_scalar<<<2112, 256, 0, stream>>>(x.data_ptr<float>(), bias.data_ptr<float>(), out.data_ptr<float>(), (float)scale, x.numel(), dim);
    }
    return out;
}
"""
ext = load_inline(name="ex_sat_vec4_cuda", cpp_sources="torch::Tensor run(torch::Tensor x, torch::Tensor bias, double scale);", cuda_sources=CUDA, functions=["run"], extra_cuda_cflags=["-O3"])


class ModelNew(nn.Module):
    def __init__(self, scale):
        super().__init__()
        self.scale = scale
        self.bias = nn.Parameter(torch.randn(16384))

    def forward(self, x):
        return ext.run(x.contiguous(), self.bias.contiguous(), self.scale)
