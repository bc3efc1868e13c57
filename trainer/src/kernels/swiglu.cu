// The SwiGLU gate for the trainer's CUDA path (swiglu.rs): from the fused gate-and-up
// projection `[rows, 2n]` (gate in the first n columns, up in the last n),
//
//   forward:  y = silu(g) · u,  silu(g) = g · σ(g)
//   backward: dg = dy · u · σ(g) · (1 + g · (1 − σ(g))),  du = dy · silu(g)
//
// one thread per output element, the gradient written into one `[rows, 2n]` tensor. Composed
// of burn operations the backward also zero-filled and slice-assigned the two halves.

template <typename T>
__device__ void swiglu(const T* gu, T* y, long long rows, long long n, long long gu_row, long long y_row) {
    const long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= rows * n) return;
    const long long r = e / n, j = e % n;
    const float g = load(gu, r * gu_row + j), u = load(gu, r * gu_row + n + j);
    const float s = 1.0f / (1.0f + __expf(-g));
    store(y, r * y_row + j, g * s * u);
}

template <typename T>
__device__ void swiglu_grad(const T* gu, const T* dy, T* dgu, long long rows, long long n, long long gu_row, long long dy_row,
                            long long dgu_row) {
    const long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= rows * n) return;
    const long long r = e / n, j = e % n;
    const float g = load(gu, r * gu_row + j), u = load(gu, r * gu_row + n + j), d = load(dy, r * dy_row + j);
    const float s = 1.0f / (1.0f + __expf(-g));
    store(dgu, r * dgu_row + j, d * u * s * (1.0f + g * (1.0f - s)));
    store(dgu, r * dgu_row + n + j, d * g * s);
}

extern "C" __global__ void swiglu_f32(const float* gu, float* y, long long rows, long long n, long long gu_row, long long y_row) {
    swiglu<float>(gu, y, rows, n, gu_row, y_row);
}
extern "C" __global__ void swiglu_bf16(const bf16_t* gu, bf16_t* y, long long rows, long long n, long long gu_row, long long y_row) {
    swiglu<bf16_t>(gu, y, rows, n, gu_row, y_row);
}
extern "C" __global__ void swiglu_grad_f32(const float* gu, const float* dy, float* dgu, long long rows, long long n, long long gu_row,
                                           long long dy_row, long long dgu_row) {
    swiglu_grad<float>(gu, dy, dgu, rows, n, gu_row, dy_row, dgu_row);
}
extern "C" __global__ void swiglu_grad_bf16(const bf16_t* gu, const bf16_t* dy, bf16_t* dgu, long long rows, long long n, long long gu_row,
                                            long long dy_row, long long dgu_row) {
    swiglu_grad<bf16_t>(gu, dy, dgu, rows, n, gu_row, dy_row, dgu_row);
}
