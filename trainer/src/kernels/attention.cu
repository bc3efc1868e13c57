// Attention's row-wise steps for the trainer's CUDA path (trainer/src/kernels/attention.rs):
// the masked softmax of the scores and the gradient of the scores, one thread block per row
// of `[batch, heads, queries, keys]`. The products around them run on cuBLAS.
//
// Compiled at run time with NVRTC, without headers: bf16 is handled as its bits. Every
// parameter is 8 bytes (pointers, long long, double) so the host passes one u64 per argument.

typedef unsigned short bf16_t;

#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ float load(const float* p, long long i) { return p[i]; }
__device__ __forceinline__ float load(const bf16_t* p, long long i) {
    return __uint_as_float(((unsigned int)p[i]) << 16);
}
__device__ __forceinline__ void store(float* p, long long i, float v) { p[i] = v; }
__device__ __forceinline__ void store(bf16_t* p, long long i, float v) {
    unsigned int u = __float_as_uint(v);
    if ((u & 0x7fffffffu) > 0x7f800000u) {  // NaN stays NaN
        p[i] = (bf16_t)((u >> 16) | 0x40u);
        return;
    }
    u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
    p[i] = (bf16_t)(u >> 16);
}

__device__ __forceinline__ float warp_reduce(float v, bool is_max) {
    for (int o = 16; o > 0; o >>= 1) {
        float other = __shfl_xor_sync(0xffffffffu, v, o);
        v = is_max ? fmaxf(v, other) : v + other;
    }
    return v;
}

// Maximum or sum over the block; every thread gets the result.
__device__ float block_reduce(float v, bool is_max) {
    __shared__ float partial[32];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_reduce(v, is_max);
    __syncthreads();  // the previous call's readers are done with partial[0]
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    int warps = (blockDim.x + 31) >> 5;
    v = (int)threadIdx.x < warps ? partial[threadIdx.x] : (is_max ? NEG_INF : 0.0f);
    if (warp == 0) v = warp_reduce(v, is_max);
    if (threadIdx.x == 0) partial[0] = v;
    __syncthreads();
    return partial[0];
}

__device__ __forceinline__ bool hidden(const unsigned char* mask, long long mask_bytes, long long at) {
    if (mask_bytes == 0) return false;
    if (mask_bytes == 1) return mask[at] != 0;
    return ((const unsigned int*)mask)[at] != 0u;
}

// In place: scores -> softmax(scores * scale) over keys, hidden keys (mask true, or after the
// query when causal, aligned at the bottom right) get probability 0; a row with every key
// hidden becomes zeros. Strides in elements; the keys of a row are contiguous.
template <typename T>
__device__ void softmax_rows(T* s, const unsigned char* mask, long long heads, long long q_len,
                             long long k_len, long long s_b, long long s_h, long long s_q,
                             long long mask_bytes, long long m_b, long long m_h, long long m_q,
                             long long m_k, long long causal, double scale_d) {
    const float scale = (float)scale_d;
    const long long row = blockIdx.x;
    const long long qi = row % q_len, bh = row / q_len, hi = bh % heads, bi = bh / heads;
    T* r = s + bi * s_b + hi * s_h + qi * s_q;
    const long long m_row = bi * m_b + hi * m_h + qi * m_q;
    const long long last_visible = causal ? qi + (k_len - q_len) : k_len - 1;
    float mx = NEG_INF;
    for (long long j = threadIdx.x; j < k_len; j += blockDim.x) {
        if (j <= last_visible && !hidden(mask, mask_bytes, m_row + j * m_k)) mx = fmaxf(mx, load(r, j) * scale);
    }
    mx = block_reduce(mx, true);
    float sum = 0.0f;
    for (long long j = threadIdx.x; j < k_len; j += blockDim.x) {
        if (j <= last_visible && !hidden(mask, mask_bytes, m_row + j * m_k)) sum += expf(load(r, j) * scale - mx);
    }
    sum = block_reduce(sum, false);
    const float inv = (mx == NEG_INF || sum == 0.0f) ? 0.0f : 1.0f / sum;
    for (long long j = threadIdx.x; j < k_len; j += blockDim.x) {
        const bool visible = j <= last_visible && !hidden(mask, mask_bytes, m_row + j * m_k);
        store(r, j, visible ? expf(load(r, j) * scale - mx) * inv : 0.0f);
    }
}

// In place: dP -> dS = P * (dP - D) * scale, where D = sum over the head dimension of
// dO * O for the row (equal to the row sum of dP * P).
template <typename T>
__device__ void grad_scores(T* dp, const T* p, const T* dout, const T* out, long long heads,
                            long long q_len, long long k_len, long long dim, long long dp_b,
                            long long dp_h, long long dp_q, long long p_b, long long p_h,
                            long long p_q, long long g_b, long long g_h, long long g_q,
                            long long g_d, long long o_b, long long o_h, long long o_q,
                            long long o_d, double scale_d) {
    const float scale = (float)scale_d;
    const long long row = blockIdx.x;
    const long long qi = row % q_len, bh = row / q_len, hi = bh % heads, bi = bh / heads;
    const T* g = dout + bi * g_b + hi * g_h + qi * g_q;
    const T* o = out + bi * o_b + hi * o_h + qi * o_q;
    float d = 0.0f;
    for (long long i = threadIdx.x; i < dim; i += blockDim.x) d += load(g, i * g_d) * load(o, i * o_d);
    d = block_reduce(d, false);
    T* dr = dp + bi * dp_b + hi * dp_h + qi * dp_q;
    const T* pr = p + bi * p_b + hi * p_h + qi * p_q;
    for (long long j = threadIdx.x; j < k_len; j += blockDim.x) {
        store(dr, j, load(pr, j) * (load(dr, j) - d) * scale);
    }
}

#define SOFTMAX_ARGS                                                                          \
    const unsigned char *mask, long long heads, long long q_len, long long k_len, long long s_b, \
        long long s_h, long long s_q, long long mask_bytes, long long m_b, long long m_h,       \
        long long m_q, long long m_k, long long causal, double scale
#define SOFTMAX_PASS mask, heads, q_len, k_len, s_b, s_h, s_q, mask_bytes, m_b, m_h, m_q, m_k, causal, scale

extern "C" __global__ void softmax_rows_f32(float* s, SOFTMAX_ARGS) { softmax_rows<float>(s, SOFTMAX_PASS); }
extern "C" __global__ void softmax_rows_bf16(bf16_t* s, SOFTMAX_ARGS) { softmax_rows<bf16_t>(s, SOFTMAX_PASS); }

#define GRAD_ARGS                                                                              \
    long long heads, long long q_len, long long k_len, long long dim, long long dp_b,          \
        long long dp_h, long long dp_q, long long p_b, long long p_h, long long p_q,           \
        long long g_b, long long g_h, long long g_q, long long g_d, long long o_b, long long o_h, \
        long long o_q, long long o_d, double scale
#define GRAD_PASS heads, q_len, k_len, dim, dp_b, dp_h, dp_q, p_b, p_h, p_q, g_b, g_h, g_q, g_d, o_b, o_h, o_q, o_d, scale

extern "C" __global__ void grad_scores_f32(float* dp, const float* p, const float* dout, const float* out, GRAD_ARGS) {
    grad_scores<float>(dp, p, dout, out, GRAD_PASS);
}
extern "C" __global__ void grad_scores_bf16(bf16_t* dp, const bf16_t* p, const bf16_t* dout, const bf16_t* out, GRAD_ARGS) {
    grad_scores<bf16_t>(dp, p, dout, out, GRAD_PASS);
}
