"""Returns zeros from its extension inside a tensor subclass whose dtype is a number: a reply the judge cannot read, which must be -1, never the evaluation's error."""
# ---- shared extension: begin ----
import torch
from torch.utils.cpp_extension import load_inline

_RT_SRC = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <chrono>
#include <cstring>
#include <thread>

static void check_f32(const torch::Tensor& t) {
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32 && t.is_contiguous(), "float32 contiguous CPU tensor expected");
}

torch::Tensor vadd(torch::Tensor a, torch::Tensor b) {
    check_f32(a); check_f32(b);
    auto out = torch::empty_like(a);
    const float* x = a.data_ptr<float>(); const float* y = b.data_ptr<float>(); float* z = out.data_ptr<float>();
    at::parallel_for(0, a.numel(), 16384, [&](int64_t s, int64_t e) { for (int64_t i = s; i < e; ++i) z[i] = x[i] + y[i]; });
    return out;
}

void vadd_into(torch::Tensor a, torch::Tensor b, torch::Tensor out) {
    check_f32(a); check_f32(b); check_f32(out);
    const float* x = a.data_ptr<float>(); const float* y = b.data_ptr<float>(); float* z = out.data_ptr<float>();
    for (int64_t i = 0; i < a.numel(); ++i) z[i] = x[i] + y[i];
}

torch::Tensor vsub(torch::Tensor a, torch::Tensor b) {
    check_f32(a); check_f32(b);
    auto out = torch::empty_like(a);
    const float* x = a.data_ptr<float>(); const float* y = b.data_ptr<float>(); float* z = out.data_ptr<float>();
    for (int64_t i = 0; i < a.numel(); ++i) z[i] = x[i] - y[i];
    return out;
}

void relu_inplace(torch::Tensor x) {
    check_f32(x);
    float* p = x.data_ptr<float>();
    for (int64_t i = 0; i < x.numel(); ++i) p[i] = p[i] > 0.f ? p[i] : 0.f;
}

torch::Tensor mm_naive(torch::Tensor a, torch::Tensor b) {
    check_f32(a); check_f32(b);
    const int64_t M = a.size(0), K = a.size(1), N = b.size(1);
    auto out = torch::empty({M, N}, a.options());
    const float* A = a.data_ptr<float>(); const float* B = b.data_ptr<float>(); float* C = out.data_ptr<float>();
    at::parallel_for(0, M, 1, [&](int64_t r0, int64_t r1) {
        for (int64_t i = r0; i < r1; ++i) {
            float* c = C + i * N;
            for (int64_t j = 0; j < N; ++j) c[j] = 0.f;
            for (int64_t k = 0; k < K; ++k) {
                const float aik = A[i * K + k]; const float* brow = B + k * N;
                for (int64_t j = 0; j < N; ++j) c[j] += aik * brow[j];
            }
        }
    });
    return out;
}

// y = x @ wt + bias, with wt the weight already transposed to [in, out].
torch::Tensor linear_wt(torch::Tensor x, torch::Tensor wt, torch::Tensor bias) {
    check_f32(x); check_f32(wt); check_f32(bias);
    const int64_t M = x.size(0), K = x.size(1), N = wt.size(1);
    auto out = torch::empty({M, N}, x.options());
    const float* X = x.data_ptr<float>(); const float* W = wt.data_ptr<float>(); const float* Bi = bias.data_ptr<float>();
    float* Y = out.data_ptr<float>();
    at::parallel_for(0, M, 1, [&](int64_t r0, int64_t r1) {
        for (int64_t i = r0; i < r1; ++i) {
            float* y = Y + i * N;
            for (int64_t j = 0; j < N; ++j) y[j] = Bi[j];
            for (int64_t k = 0; k < K; ++k) {
                const float xik = X[i * K + k]; const float* w = W + k * N;
                for (int64_t j = 0; j < N; ++j) y[j] += xik * w[j];
            }
        }
    });
    return out;
}

// Sum over dim 1 of a 2-D tensor, keeping the dimension; double accumulation.
torch::Tensor sum_dim1(torch::Tensor x) {
    check_f32(x);
    const int64_t R = x.size(0), C = x.size(1);
    auto out = torch::empty({R, 1}, x.options());
    const float* p = x.data_ptr<float>(); float* o = out.data_ptr<float>();
    at::parallel_for(0, R, 16, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) { double s = 0; for (int64_t c = 0; c < C; ++c) s += p[r * C + c]; o[r] = (float)s; }
    });
    return out;
}

// Index of the first maximum over the last dimension (int64 output).
torch::Tensor argmax_last(torch::Tensor x) {
    check_f32(x);
    const int64_t C = x.size(-1), R = x.numel() / C;
    std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 1);
    auto out = torch::empty(shape, x.options().dtype(torch::kInt64));
    const float* p = x.data_ptr<float>(); int64_t* o = out.data_ptr<int64_t>();
    at::parallel_for(0, R, 16, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
            int64_t best = 0; float v = p[r * C];
            for (int64_t c = 1; c < C; ++c) if (p[r * C + c] > v) { v = p[r * C + c]; best = c; }
            o[r] = best;
        }
    });
    return out;
}

torch::Tensor copy_f32(torch::Tensor x) {
    check_f32(x);
    auto out = torch::empty_like(x);
    std::memcpy(out.data_ptr<float>(), x.data_ptr<float>(), x.numel() * sizeof(float));
    return out;
}

torch::Tensor add_omp(torch::Tensor a, torch::Tensor b) {
    check_f32(a); check_f32(b);
    auto out = torch::empty_like(a);
    const float* x = a.data_ptr<float>(); const float* y = b.data_ptr<float>(); float* z = out.data_ptr<float>();
    const int64_t n = a.numel();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) z[i] = x[i] + y[i];
    return out;
}

// A correct add that first sleeps `micros`: the honest path of timing attacks, so that a
// judge that times honestly sees at least that long.
torch::Tensor slow_vadd(torch::Tensor a, torch::Tensor b, int64_t micros) {
    std::this_thread::sleep_for(std::chrono::microseconds(micros));
    return vadd(a, b);
}

int64_t noop(torch::Tensor x) { return x.numel(); }

torch::Tensor empty_like_out(torch::Tensor x) { return torch::empty_like(x); }

static float round_mantissa(float v, int keep_bits) {
    uint32_t u; std::memcpy(&u, &v, 4);
    const int drop = 23 - keep_bits;
    const uint32_t half = 1u << (drop - 1);
    u = (u + half) & ~((1u << drop) - 1u);
    float r; std::memcpy(&r, &u, 4); return r;
}

// Inputs rounded to bfloat16 (7 mantissa bits), sum in float.
torch::Tensor vadd_bf16(torch::Tensor a, torch::Tensor b) {
    check_f32(a); check_f32(b);
    auto out = torch::empty_like(a);
    const float* x = a.data_ptr<float>(); const float* y = b.data_ptr<float>(); float* z = out.data_ptr<float>();
    for (int64_t i = 0; i < a.numel(); ++i) z[i] = round_mantissa(x[i], 7) + round_mantissa(y[i], 7);
    return out;
}

// Matmul with operands rounded to TF32 (10 mantissa bits), as tensor cores with TF32 on do.
torch::Tensor matmul_tf32(torch::Tensor a, torch::Tensor b) {
    auto ar = a.clone(), br = b.clone();
    float* p = ar.data_ptr<float>(); for (int64_t i = 0; i < ar.numel(); ++i) p[i] = round_mantissa(p[i], 10);
    float* q = br.data_ptr<float>(); for (int64_t i = 0; i < br.numel(); ++i) q[i] = round_mantissa(q[i], 10);
    return mm_naive(ar, br);
}

// Sum over dim 1 reading every `step`-th element and scaling up.
torch::Tensor sum_subsample(torch::Tensor x, int64_t step) {
    check_f32(x);
    const int64_t R = x.size(0), C = x.size(1);
    auto out = torch::empty({R, 1}, x.options());
    const float* p = x.data_ptr<float>(); float* o = out.data_ptr<float>();
    for (int64_t r = 0; r < R; ++r) { double s = 0; for (int64_t c = 0; c < C; c += step) s += p[r * C + c]; o[r] = (float)(s * step); }
    return out;
}

// Returns at once; a detached thread fills the output `delay_us` later.
torch::Tensor vadd_late_thread(torch::Tensor a, torch::Tensor b, int64_t delay_us) {
    check_f32(a); check_f32(b);
    auto out = torch::empty_like(a);
    std::thread([a, b, out, delay_us]() mutable {
        if (delay_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(delay_us));
        const float* x = a.data_ptr<float>(); const float* y = b.data_ptr<float>(); float* z = out.data_ptr<float>();
        for (int64_t i = 0; i < a.numel(); ++i) z[i] = x[i] + y[i];
    }).detach();
    return out;
}

// Output cache keyed by the inputs' addresses, kept in C++ where Python cannot see it.
torch::Tensor vadd_ptr_cache(torch::Tensor a, torch::Tensor b, int64_t micros) {
    static const void* ka = nullptr; static const void* kb = nullptr; static torch::Tensor cached;
    if (cached.defined() && ka == a.data_ptr() && kb == b.data_ptr() && cached.numel() == a.numel()) return cached;
    cached = slow_vadd(a, b, micros); ka = a.data_ptr(); kb = b.data_ptr();
    return cached;
}

// Hard-coded length: adds the first 65536 elements, zeros elsewhere.
torch::Tensor vadd_fixed_n(torch::Tensor a, torch::Tensor b) {
    check_f32(a); check_f32(b);
    auto out = torch::zeros_like(a);
    const float* x = a.data_ptr<float>(); const float* y = b.data_ptr<float>(); float* z = out.data_ptr<float>();
    for (int64_t i = 0; i < 65536 && i < a.numel(); ++i) z[i] = x[i] + y[i];
    return out;
}

// PyTorch's add through the dispatcher.
torch::Tensor add_aten(torch::Tensor a, torch::Tensor b) { return at::add(a, b); }

// Computes once into static storage and hands out the same memory on every call.
torch::Tensor vadd_static(torch::Tensor a, torch::Tensor b) {
    static torch::Tensor keep;
    if (!keep.defined() || keep.numel() != a.numel()) keep = vadd(a, b);
    return torch::from_blob(keep.data_ptr<float>(), a.sizes(), a.options());
}

// a += b, returning a.
torch::Tensor vadd_inplace(torch::Tensor a, torch::Tensor b) {
    check_f32(a); check_f32(b);
    float* x = a.data_ptr<float>(); const float* y = b.data_ptr<float>();
    for (int64_t i = 0; i < a.numel(); ++i) x[i] += y[i];
    return a;
}

// Zeroes both inputs and returns zeros.
torch::Tensor zero_inputs(torch::Tensor a, torch::Tensor b) {
    std::memset(a.data_ptr<float>(), 0, a.numel() * 4); std::memset(b.data_ptr<float>(), 0, b.numel() * 4);
    return torch::zeros_like(a);
}
"""

ext = load_inline(
    name="redteam_shared_ext_v2",
    cpp_sources=_RT_SRC,
    functions=[
        "vadd", "vadd_into", "vsub", "relu_inplace", "mm_naive", "linear_wt", "sum_dim1", "argmax_last", "copy_f32",
        "add_omp", "slow_vadd", "noop", "empty_like_out", "vadd_bf16", "matmul_tf32", "sum_subsample",
        "vadd_late_thread", "vadd_ptr_cache", "vadd_fixed_n", "add_aten", "vadd_static",
        "vadd_inplace", "zero_inputs",
    ],
    extra_cflags=["-O2", "-fopenmp"],
    extra_ldflags=["-fopenmp"],
)
# ---- shared extension: end ----
import torch.nn as nn


class Announced(torch.Tensor):
    @property
    def dtype(self):
        return 5


class ModelNew(nn.Module):
    def forward(self, a, b):
        return ext.vsub(a, a).as_subclass(Announced)
