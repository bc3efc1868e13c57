// Next-token statistics over the vocabulary for the trainer's CUDA path (vocab.rs): for each
// row of logits z (one sequence position), with x = z / temperature,
//
//   lse = log sum_j exp(x_j),   logprob = x_target - lse,   entropy = lse - sum_j p_j x_j
//
// in one read of the row (an online softmax: running maximum, sum of exponentials, and sum of
// exponentials times x, rescaled together), and the gradient of both statistics in one more
// read and one write:
//
//   dz_j = (g_logprob (1[j = target] - p_j) - g_entropy p_j (log p_j + entropy)) / temperature
//
// One thread block per row. Decomposed into burn operations this was a dozen passes over a
// `[rows, 151936]` f32 tensor.

// Running (max, sum of exp(x - max), sum of exp(x - max) * x).
struct Acc {
    float m, s, w;
};

__device__ __forceinline__ void acc_add(Acc& a, float x) {
    if (x == NEG_INF) return;  // probability 0; exp(-inf - -inf) would be NaN
    if (x > a.m) {
        const float r = __expf(a.m - x);  // 0 while a.m is -inf
        a.s = a.s * r + 1.0f;
        a.w = a.w * r + x;
        a.m = x;
    } else {
        const float e = __expf(x - a.m);
        a.s += e;
        a.w += e * x;
    }
}

__device__ __forceinline__ Acc acc_merge(Acc a, Acc b) {
    const float m = fmaxf(a.m, b.m);
    if (m == NEG_INF) return a;
    const float ra = __expf(a.m - m), rb = __expf(b.m - m);
    Acc c = {m, a.s * ra + b.s * rb, a.w * ra + b.w * rb};
    return c;
}

__device__ Acc block_merge(Acc a) {
    __shared__ float part[3][32];
    for (int o = 16; o > 0; o >>= 1) {
        Acc b = {__shfl_xor_sync(0xffffffffu, a.m, o), __shfl_xor_sync(0xffffffffu, a.s, o), __shfl_xor_sync(0xffffffffu, a.w, o)};
        a = acc_merge(a, b);
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
    if (lane == 0) {
        part[0][warp] = a.m;
        part[1][warp] = a.s;
        part[2][warp] = a.w;
    }
    __syncthreads();
    if (warp == 0) {
        Acc b = {NEG_INF, 0.0f, 0.0f};
        if (lane < warps) b = Acc{part[0][lane], part[1][lane], part[2][lane]};
        for (int o = 16; o > 0; o >>= 1) {
            Acc c = {__shfl_xor_sync(0xffffffffu, b.m, o), __shfl_xor_sync(0xffffffffu, b.s, o), __shfl_xor_sync(0xffffffffu, b.w, o)};
            b = acc_merge(b, c);
        }
        if (lane == 0) {
            part[0][0] = b.m;
            part[1][0] = b.s;
            part[2][0] = b.w;
        }
    }
    __syncthreads();
    Acc r = {part[0][0], part[1][0], part[2][0]};
    return r;
}

// stats[row] = (logprob, entropy) with row stride st_row; lse[row * lse_s]. A target outside
// the vocabulary gives a NaN log-probability.
template <typename T>
__device__ void token_stats(const T* z, const int* targets, float* stats, float* lse_out, long long vocab, long long z_row,
                            long long t_s, long long st_row, long long lse_s, double inv_temp_d) {
    const float inv_temp = (float)inv_temp_d;
    const long long row = blockIdx.x;
    const T* r = z + row * z_row;
    Acc a = {NEG_INF, 0.0f, 0.0f};
    if (vector_rows(z, vocab, z_row)) {
        const int n = Vec16<T>::N;
        float v[Vec16<T>::N];
        for (long long j = (long long)threadIdx.x * n; j < vocab; j += (long long)blockDim.x * n) {
            Vec16<T>::load(r, j, v);
#pragma unroll
            for (int k = 0; k < n; k++) acc_add(a, v[k] * inv_temp);
        }
    } else {
        for (long long j = threadIdx.x; j < vocab; j += blockDim.x) acc_add(a, load(r, j) * inv_temp);
    }
    a = block_merge(a);
    if (threadIdx.x == 0) {
        const float lse = a.m + logf(a.s);
        const int t = targets[row * t_s];
        const float lp = (t >= 0 && t < vocab) ? load(r, t) * inv_temp - lse : __int_as_float(0x7fc00000);
        stats[row * st_row] = lp;
        stats[row * st_row + 1] = lse - a.w / a.s;
        lse_out[row * lse_s] = lse;
    }
}

template <typename T>
__device__ __forceinline__ float stats_grad(float x, long long j, int t, float lse, float entropy, float g_lp, float g_h, float inv_temp) {
    const float lp = x - lse;
    const float p = __expf(lp);
    float d = -g_lp * p - g_h * p * (lp + entropy);
    if (j == t) d += g_lp;
    return d * inv_temp;
}

template <typename T>
__device__ void token_stats_grad(const T* z, const int* targets, const float* lse_in, const float* stats, const float* grad, T* dz,
                                 long long vocab, long long z_row, long long t_s, long long lse_s, long long st_row, long long g_row,
                                 long long g_col, long long dz_row, double inv_temp_d) {
    const float inv_temp = (float)inv_temp_d;
    const long long row = blockIdx.x;
    const T* r = z + row * z_row;
    T* out = dz + row * dz_row;
    const int t = targets[row * t_s];
    const float lse = lse_in[row * lse_s], entropy = stats[row * st_row + 1];
    const float g_lp = grad[row * g_row], g_h = grad[row * g_row + g_col];
    if (vector_rows(z, vocab, z_row) && vector_rows((const T*)dz, vocab, dz_row)) {
        const int n = Vec16<T>::N;
        float v[Vec16<T>::N];
        for (long long j = (long long)threadIdx.x * n; j < vocab; j += (long long)blockDim.x * n) {
            Vec16<T>::load(r, j, v);
#pragma unroll
            for (int k = 0; k < n; k++) v[k] = stats_grad<T>(v[k] * inv_temp, j + k, t, lse, entropy, g_lp, g_h, inv_temp);
            Vec16<T>::store(out, j, v);
        }
    } else {
        for (long long j = threadIdx.x; j < vocab; j += blockDim.x) {
            store(out, j, stats_grad<T>(load(r, j) * inv_temp, j, t, lse, entropy, g_lp, g_h, inv_temp));
        }
    }
}

#define STATS_ARGS const int *targets, float *stats, float *lse, long long vocab, long long z_row, long long t_s, long long st_row, long long lse_s, double inv_temp
#define STATS_PASS targets, stats, lse, vocab, z_row, t_s, st_row, lse_s, inv_temp
extern "C" __global__ void token_stats_f32(const float* z, STATS_ARGS) { token_stats<float>(z, STATS_PASS); }
extern "C" __global__ void token_stats_bf16(const bf16_t* z, STATS_ARGS) { token_stats<bf16_t>(z, STATS_PASS); }

#define GRAD_ARGS                                                                                                    \
    const int *targets, const float *lse, const float *stats, const float *grad, long long vocab, long long z_row,    \
        long long t_s, long long lse_s, long long st_row, long long g_row, long long g_col, long long dz_row, double inv_temp
#define GRAD_PASS targets, lse, stats, grad, dz, vocab, z_row, t_s, lse_s, st_row, g_row, g_col, dz_row, inv_temp
extern "C" __global__ void token_stats_grad_f32(const float* z, float* dz, GRAD_ARGS) { token_stats_grad<float>(z, GRAD_PASS); }
extern "C" __global__ void token_stats_grad_bf16(const bf16_t* z, bf16_t* dz, GRAD_ARGS) { token_stats_grad<bf16_t>(z, GRAD_PASS); }
