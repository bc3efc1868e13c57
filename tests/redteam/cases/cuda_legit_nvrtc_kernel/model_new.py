"""The add as a kernel compiled at run time by NVRTC (torch.cuda._compile_kernel): no extension
to build, the kernel launched on the current stream with the tensors' pointers."""
import torch
import torch.nn as nn

SRC = r"""
extern "C" __global__ void add_k(const float4* a, const float4* b, float4* out, const float* a1,
                                 const float* b1, float* out1, int n4, int n) {
    int stride = gridDim.x * blockDim.x;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n4; i += stride) {
        float4 x = a[i], y = b[i];
        out[i] = make_float4(x.x + y.x, x.y + y.y, x.z + y.z, x.w + y.w);
    }
    // The tail past the last whole float4.
    for (int i = 4 * n4 + blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) out1[i] = a1[i] + b1[i];
}
"""


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        self.kernel = None

    def forward(self, a, b):
        if self.kernel is None:  # compiled on the device the inputs are on, once
            self.kernel = torch.cuda._compile_kernel(SRC, "add_k")
        a, b = a.contiguous(), b.contiguous()
        out = torch.empty_like(a)
        n = a.numel()  # NVRTC launches pass Python ints as 32-bit C ints
        threads = 256
        blocks = min(max(1, (n // 4 + threads - 1) // threads), 132 * 16)
        self.kernel(grid=(blocks, 1, 1), block=(threads, 1, 1), args=[a, b, out, a, b, out, n // 4, n])
        return out
