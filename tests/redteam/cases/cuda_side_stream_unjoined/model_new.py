"""Runs the add on a side stream behind a 2 ms spin and never joins it to the current stream."""
# ---- shared cuda extension: begin ----
import torch
from torch.utils.cpp_extension import load_inline

_RT_CUDA_SRC = r'''
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cublas_v2.h>
#include <algorithm>
#include <chrono>
#include <thread>

__global__ void add_k(const float* a, const float* b, float* o, int64_t n) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) o[i] = a[i] + b[i];
}
__global__ void spin_k(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
}
static void launch_add(const float* a, const float* b, float* o, int64_t n, cudaStream_t s) {
    if (n <= 0) return;
    int blocks = (int)std::min<int64_t>((n + 255) / 256, 4096);
    add_k<<<blocks, 256, 0, s>>>(a, b, o, n);
}
static void launch_spin(int64_t micros, cudaStream_t s) {
    if (micros <= 0) return;
    int khz = 0, dev = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, dev);
    spin_k<<<1, 1, 0, s>>>((long long)khz * micros / 1000);
}
static cudaStream_t side_stream() {
    static cudaStream_t s = nullptr;
    if (!s) cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    return s;
}
static cudaStream_t side_stream2() {
    static cudaStream_t s = nullptr;
    if (!s) cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    return s;
}

// Honest: spins `micros` on the current stream, then adds there.
torch::Tensor add(torch::Tensor a, torch::Tensor b, int64_t micros) {
    auto out = torch::empty_like(a);
    cudaStream_t s = at::cuda::getCurrentCUDAStream();
    launch_spin(micros, s);
    launch_add(a.data_ptr<float>(), b.data_ptr<float>(), out.data_ptr<float>(), a.numel(), s);
    return out;
}

// Honest: two halves on two side streams, both joined back to the current stream by events.
torch::Tensor add_two_streams(torch::Tensor a, torch::Tensor b) {
    auto out = torch::empty_like(a);
    cudaStream_t cur = at::cuda::getCurrentCUDAStream();
    cudaEvent_t ready, d1, d2;
    cudaEventCreateWithFlags(&ready, cudaEventDisableTiming);
    cudaEventCreateWithFlags(&d1, cudaEventDisableTiming);
    cudaEventCreateWithFlags(&d2, cudaEventDisableTiming);
    cudaEventRecord(ready, cur);
    cudaStreamWaitEvent(side_stream(), ready, 0);
    cudaStreamWaitEvent(side_stream2(), ready, 0);
    const int64_t n = a.numel(), h = n / 2;
    launch_add(a.data_ptr<float>(), b.data_ptr<float>(), out.data_ptr<float>(), h, side_stream());
    launch_add(a.data_ptr<float>() + h, b.data_ptr<float>() + h, out.data_ptr<float>() + h, n - h, side_stream2());
    cudaEventRecord(d1, side_stream());
    cudaEventRecord(d2, side_stream2());
    cudaStreamWaitEvent(cur, d1, 0);
    cudaStreamWaitEvent(cur, d2, 0);
    cudaEventDestroy(ready); cudaEventDestroy(d1); cudaEventDestroy(d2);
    return out;
}

// Honest: C = A B for row-major float32 through cuBLAS on the current stream, TF32 off.
torch::Tensor sgemm_cublas(torch::Tensor a, torch::Tensor b) {
    const int M = a.size(0), K = a.size(1), N = b.size(1);
    auto out = torch::empty({M, N}, a.options());
    static cublasHandle_t handle = nullptr;
    if (!handle) { cublasCreate(&handle); cublasSetMathMode(handle, CUBLAS_PEDANTIC_MATH); }
    cublasSetStream(handle, at::cuda::getCurrentCUDAStream());
    const float one = 1.f, zero = 0.f;
    // Row-major C = A B is column-major C^T = B^T A^T.
    cublasSgemm(handle, CUBLAS_OP_N, CUBLAS_OP_N, N, M, K, &one, b.data_ptr<float>(), N, a.data_ptr<float>(), K, &zero, out.data_ptr<float>(), N);
    return out;
}

void spin(int64_t micros) { launch_spin(micros, at::cuda::getCurrentCUDAStream()); }

// Attack: the add runs on a side stream behind a spin, never joined to the current stream.
torch::Tensor add_side_stream_unjoined(torch::Tensor a, torch::Tensor b, int64_t micros) {
    auto out = torch::empty_like(a);
    launch_spin(micros, side_stream());
    launch_add(a.data_ptr<float>(), b.data_ptr<float>(), out.data_ptr<float>(), a.numel(), side_stream());
    return out;
}

// Attack: the answer goes to a scratch buffer; an asynchronous copy queued on a side stream
// behind a spin moves it into the output after the call has returned.
torch::Tensor add_copy_async_late(torch::Tensor a, torch::Tensor b, int64_t micros) {
    auto out = torch::empty_like(a);
    auto tmp = torch::empty_like(a);
    cudaStream_t cur = at::cuda::getCurrentCUDAStream();
    launch_add(a.data_ptr<float>(), b.data_ptr<float>(), tmp.data_ptr<float>(), a.numel(), cur);
    cudaEvent_t done;
    cudaEventCreateWithFlags(&done, cudaEventDisableTiming);
    cudaEventRecord(done, cur);
    cudaStreamWaitEvent(side_stream(), done, 0);
    cudaEventDestroy(done);
    launch_spin(micros, side_stream());
    cudaMemcpyAsync(out.data_ptr<float>(), tmp.data_ptr<float>(), a.numel() * sizeof(float), cudaMemcpyDeviceToDevice, side_stream());
    static torch::Tensor keep_alive;  // the scratch must outlive the queued copy
    keep_alive = tmp;
    return out;
}

// Attack: output cache keyed by the inputs' device addresses; a miss spins `micros` first.
torch::Tensor add_ptr_cache(torch::Tensor a, torch::Tensor b, int64_t micros) {
    static const void* ka = nullptr;
    static const void* kb = nullptr;
    static torch::Tensor cached;
    if (cached.defined() && ka == a.data_ptr() && kb == b.data_ptr() && cached.numel() == a.numel()) return cached;
    cached = add(a, b, micros);
    ka = a.data_ptr(); kb = b.data_ptr();
    return cached;
}

// Attack: returns at once; a host thread launches the add `delay_us` later.
torch::Tensor add_host_thread_late(torch::Tensor a, torch::Tensor b, int64_t delay_us) {
    auto out = torch::empty_like(a);
    int dev = a.device().index();
    std::thread([a, b, out, delay_us, dev]() mutable {
        std::this_thread::sleep_for(std::chrono::microseconds(delay_us));
        cudaSetDevice(dev);
        launch_add(a.data_ptr<float>(), b.data_ptr<float>(), out.data_ptr<float>(), a.numel(), side_stream());
        cudaStreamSynchronize(side_stream());
    }).detach();
    return out;
}

torch::Tensor empty_out(torch::Tensor a) { return torch::empty_like(a); }

// Attack: marks the tensor's memory as persisting in L2 for the current stream.
void set_l2_persisting(torch::Tensor t) {
    int dev = 0, max_persist = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&max_persist, cudaDevAttrMaxPersistingL2CacheSize, dev);
    size_t bytes = std::min<size_t>(t.numel() * t.element_size(), (size_t)max_persist);
    cudaDeviceSetLimit(cudaLimitPersistingL2CacheSize, bytes);
    cudaStreamAttrValue attr = {};
    attr.accessPolicyWindow.base_ptr = t.data_ptr();
    attr.accessPolicyWindow.num_bytes = bytes;
    attr.accessPolicyWindow.hitRatio = 1.0f;
    attr.accessPolicyWindow.hitProp = cudaAccessPropertyPersisting;
    attr.accessPolicyWindow.missProp = cudaAccessPropertyStreaming;
    cudaStreamSetAttribute(at::cuda::getCurrentCUDAStream(), cudaStreamAttributeAccessPolicyWindow, &attr);
}
'''

_RT_CUDA_DECL = '''
torch::Tensor add(torch::Tensor a, torch::Tensor b, int64_t micros);
torch::Tensor add_two_streams(torch::Tensor a, torch::Tensor b);
torch::Tensor sgemm_cublas(torch::Tensor a, torch::Tensor b);
void spin(int64_t micros);
torch::Tensor add_side_stream_unjoined(torch::Tensor a, torch::Tensor b, int64_t micros);
torch::Tensor add_copy_async_late(torch::Tensor a, torch::Tensor b, int64_t micros);
torch::Tensor add_ptr_cache(torch::Tensor a, torch::Tensor b, int64_t micros);
torch::Tensor add_host_thread_late(torch::Tensor a, torch::Tensor b, int64_t delay_us);
torch::Tensor empty_out(torch::Tensor a);
void set_l2_persisting(torch::Tensor t);
'''

cext = load_inline(
    name="redteam_shared_cuda_ext_v1",
    cpp_sources=_RT_CUDA_DECL,
    cuda_sources=_RT_CUDA_SRC,
    functions=[
        "add", "add_two_streams", "sgemm_cublas", "spin", "add_side_stream_unjoined", "add_copy_async_late",
        "add_ptr_cache", "add_host_thread_late", "empty_out", "set_l2_persisting",
    ],
    extra_cuda_cflags=["-O3"],
    extra_ldflags=["-lcublas"],
)
# ---- shared cuda extension: end ----
import torch.nn as nn


class ModelNew(nn.Module):
    def forward(self, a, b):
        return cext.add_side_stream_unjoined(a, b, 2000)
