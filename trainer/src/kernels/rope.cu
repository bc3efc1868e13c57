// Rotary position embedding for the trainer's CUDA path (rope.rs), the rotate-half form of
// Llama and Qwen2: for each head vector x (width 2h) at a position with angles (cos, sin),
//
//   y[i]     = x[i] · cos[i]         − x[i + h] · sin[i]
//   y[i + h] = x[i + h] · cos[i + h] + x[i] · sin[i + h]          (i < h)
//
// and its transpose for the gradient. One thread per pair (i, i + h). Composed of burn
// operations this was three slices, a negation, a concatenation and a fused multiply-add
// forward, and slice-assignments into zeros backward.

// Input `x` `[b, t, heads, 2h]` with strides (x_b, x_t, x_h, 1); angles `[b, t, 2h]` with
// strides (c_b, c_t, 1); output contiguous `[b, t, heads, 2h]`. `inverse` applies the
// transpose (the gradient).
template <typename T>
__device__ void rope(const T* x, const T* cs, const T* sn, T* y, long long pairs, long long t, long long heads, long long half,
                     long long x_b, long long x_t, long long x_h, long long c_b, long long c_t, long long inverse) {
    const long long p = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (p >= pairs) return;
    const long long i = p % half, r = p / half, head = r % heads, bt = r / heads, ti = bt % t, bi = bt / t;
    const T* xr = x + bi * x_b + ti * x_t + head * x_h;
    const T* cr = cs + bi * c_b + ti * c_t;
    const T* sr = sn + bi * c_b + ti * c_t;
    T* yr = y + ((bi * t + ti) * heads + head) * 2 * half;
    const float a = load(xr, i), b = load(xr, i + half);
    const float c1 = load(cr, i), s1 = load(sr, i), c2 = load(cr, i + half), s2 = load(sr, i + half);
    if (inverse) {
        store(yr, i, a * c1 + b * s2);
        store(yr, i + half, b * c2 - a * s1);
    } else {
        store(yr, i, a * c1 - b * s1);
        store(yr, i + half, b * c2 + a * s2);
    }
}

#define ROPE_ARGS                                                                                                   \
    long long pairs, long long t, long long heads, long long half, long long x_b, long long x_t, long long x_h, long long c_b, \
        long long c_t, long long inverse
#define ROPE_PASS pairs, t, heads, half, x_b, x_t, x_h, c_b, c_t, inverse
extern "C" __global__ void rope_f32(const float* x, const float* cs, const float* sn, float* y, ROPE_ARGS) { rope<float>(x, cs, sn, y, ROPE_PASS); }
extern "C" __global__ void rope_bf16(const bf16_t* x, const bf16_t* cs, const bf16_t* sn, bf16_t* y, ROPE_ARGS) {
    rope<bf16_t>(x, cs, sn, y, ROPE_PASS);
}
