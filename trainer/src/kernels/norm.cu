// RMSNorm for the trainer's CUDA path (norm.rs), one thread block per row of `[rows, d]`:
//
//   forward:  inv = 1 / sqrt(mean(x²) + eps);  y = x · inv · w          (inv kept per row)
//   backward: x̂ = x · inv;  c = mean((g ∘ w) ∘ x̂);  dx = inv · (g ∘ w − x̂ · c)
//             and g ∘ x̂ per element, whose column sums (one matrix product) are dw.
//
// Decomposed into burn operations a norm was a reduction and an elementwise kernel forward
// and five or six kernels backward, each reduction slow on rows this short (896 wide).

template <typename T>
__device__ void rms_norm(const T* x, const T* w, T* y, float* inv_out, long long d, long long x_row, long long y_row,
                         long long w_s, long long inv_s, double eps) {
    const long long row = blockIdx.x;
    const T* xr = x + row * x_row;
    T* yr = y + row * y_row;
    const int n = Vec16<T>::N;
    const bool vec = vector_rows(x, d, x_row) && vector_rows((const T*)y, d, y_row) && w_s == 1 && vector_rows(w, d, 0);
    float ss = 0.0f;
    if (vec) {
        float v[Vec16<T>::N];
        for (long long j = (long long)threadIdx.x * n; j < d; j += (long long)blockDim.x * n) {
            Vec16<T>::load(xr, j, v);
#pragma unroll
            for (int k = 0; k < n; k++) ss += v[k] * v[k];
        }
    } else {
        for (long long j = threadIdx.x; j < d; j += blockDim.x) {
            const float v = load(xr, j);
            ss += v * v;
        }
    }
    ss = block_reduce(ss, false);
    const float inv = rsqrtf(ss / (float)d + (float)eps);
    if (threadIdx.x == 0) inv_out[row * inv_s] = inv;
    if (vec) {
        float v[Vec16<T>::N], g[Vec16<T>::N];
        for (long long j = (long long)threadIdx.x * n; j < d; j += (long long)blockDim.x * n) {
            Vec16<T>::load(xr, j, v);
            Vec16<T>::load(w, j, g);
#pragma unroll
            for (int k = 0; k < n; k++) v[k] = v[k] * inv * g[k];
            Vec16<T>::store(yr, j, v);
        }
    } else {
        for (long long j = threadIdx.x; j < d; j += blockDim.x) store(yr, j, load(xr, j) * inv * load(w, j * w_s));
    }
}

template <typename T>
__device__ void rms_norm_grad(const T* x, const T* w, const float* inv_in, const T* g, T* dx, T* gx, long long d, long long x_row,
                              long long w_s, long long inv_s, long long g_row, long long dx_row, long long gx_row) {
    const long long row = blockIdx.x;
    const T* xr = x + row * x_row;
    const T* gr = g + row * g_row;
    T* dxr = dx + row * dx_row;
    T* gxr = gx + row * gx_row;
    const float inv = inv_in[row * inv_s];
    // Rows of a model's width fit in a few passes; the second pass re-reads from cache.
    float c = 0.0f;
    for (long long j = threadIdx.x; j < d; j += blockDim.x) c += load(gr, j) * load(w, j * w_s) * load(xr, j) * inv;
    c = block_reduce(c, false) / (float)d;
    for (long long j = threadIdx.x; j < d; j += blockDim.x) {
        const float xh = load(xr, j) * inv, gj = load(gr, j);
        store(dxr, j, inv * (gj * load(w, j * w_s) - xh * c));
        store(gxr, j, gj * xh);
    }
}

#define NORM_ARGS long long d, long long x_row, long long y_row, long long w_s, long long inv_s, double eps
#define NORM_PASS d, x_row, y_row, w_s, inv_s, eps
extern "C" __global__ void rms_norm_f32(const float* x, const float* w, float* y, float* inv, NORM_ARGS) { rms_norm<float>(x, w, y, inv, NORM_PASS); }
extern "C" __global__ void rms_norm_bf16(const bf16_t* x, const bf16_t* w, bf16_t* y, float* inv, NORM_ARGS) { rms_norm<bf16_t>(x, w, y, inv, NORM_PASS); }

#define NORM_GRAD_ARGS long long d, long long x_row, long long w_s, long long inv_s, long long g_row, long long dx_row, long long gx_row
#define NORM_GRAD_PASS d, x_row, w_s, inv_s, g_row, dx_row, gx_row
extern "C" __global__ void rms_norm_grad_f32(const float* x, const float* w, const float* inv, const float* g, float* dx, float* gx, NORM_GRAD_ARGS) {
    rms_norm_grad<float>(x, w, inv, g, dx, gx, NORM_GRAD_PASS);
}
extern "C" __global__ void rms_norm_grad_bf16(const bf16_t* x, const bf16_t* w, const float* inv, const bf16_t* g, bf16_t* dx, bf16_t* gx, NORM_GRAD_ARGS) {
    rms_norm_grad<bf16_t>(x, w, inv, g, dx, gx, NORM_GRAD_PASS);
}
