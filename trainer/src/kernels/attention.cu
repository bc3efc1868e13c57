// Attention's row-wise steps for the trainer's CUDA path (trainer/src/kernels/attention.rs):
// the masked softmax of the scores and the gradient of the scores, one warp per row of
// `[batch, heads, queries, keys]`, ROWS_PER_BLOCK rows per block. The products around them
// run on cuBLAS.
//
// Measured on an H200 (114,688 rows of 2,048 bf16 keys, a causal mask: a training pass of
// Qwen2.5-0.5B's shape): a whole block per row (the first version) was bound by the latency
// of its few loads and two block-wide reductions, 0.9 ms; a warp per row reducing with
// shuffles, 0.71 ms; reading the mask eight bytes at a time and skipping the scores of keys
// all hidden, 0.53 ms; the row kept as raw sixteen-byte vectors (4 registers each rather than
// 8 floats, so more warps fit), hardware bf16 conversion and exp2 with the scale folded in,
// 0.34 ms. Rows whose layout allows it are walked sixteen bytes at a time; rows of more than
// ROW_VECS vectors per lane, or unaligned ones, element by element in three passes.

#define ROWS_PER_BLOCK 8
#define ROW_VECS 8

__device__ __forceinline__ bool hidden(const unsigned char* mask, long long mask_bytes, long long at) {
    if (mask_bytes == 0) return false;
    if (mask_bytes == 1) return mask[at] != 0;
    return ((const unsigned int*)mask)[at] != 0u;
}

// Bit k set: key j0 + k is hidden (masked, or past the last visible key). Eight (bf16) or four
// (f32) mask bytes in one load when the mask is a unit-stride byte row aligned to them.
template <typename T>
__device__ __forceinline__ unsigned int hidden_bits(const unsigned char* mask, long long mask_bytes, long long m_row, long long m_k,
                                                    long long j0, long long last_visible) {
    const int n = Vec16<T>::N;
    unsigned int bits = 0;
    const long long at = m_row + j0;
    if (mask_bytes == 1 && m_k == 1 && ((unsigned long long)(mask + at)) % n == 0) {
        if (n == 8) {
            const uint2 w = *(const uint2*)(mask + at);
#pragma unroll
            for (int k = 0; k < 4; k++) bits |= (((w.x >> (8 * k)) & 0xffu) ? 1u : 0u) << k;
#pragma unroll
            for (int k = 0; k < 4; k++) bits |= (((w.y >> (8 * k)) & 0xffu) ? 1u : 0u) << (k + 4);
        } else {
            const unsigned int w = *(const unsigned int*)(mask + at);
#pragma unroll
            for (int k = 0; k < 4; k++) bits |= (((w >> (8 * k)) & 0xffu) ? 1u : 0u) << k;
        }
    } else {
#pragma unroll
        for (int k = 0; k < n; k++) bits |= (hidden(mask, mask_bytes, m_row + (j0 + k) * m_k) ? 1u : 0u) << k;
    }
#pragma unroll
    for (int k = 0; k < n; k++) bits |= (j0 + k > last_visible ? 1u : 0u) << k;
    return bits;
}

// The row this warp works on; `rows` or more past the last.
__device__ __forceinline__ long long warp_row() { return (long long)blockIdx.x * ROWS_PER_BLOCK + (threadIdx.x >> 5); }

// In place: scores -> softmax(scores * scale) over keys, hidden keys (mask true, or after the
// query when causal, aligned at the bottom right) get probability 0; a row with every key
// hidden becomes zeros. Strides in elements; the keys of a row are contiguous.
template <typename T>
__device__ void softmax_rows(T* s, const unsigned char* mask, long long rows, long long heads, long long q_len,
                             long long k_len, long long s_b, long long s_h, long long s_q,
                             long long mask_bytes, long long m_b, long long m_h, long long m_q,
                             long long m_k, long long causal, double scale_d) {
    const float scale = (float)scale_d;
    // exp(x · scale − m) as exp2(x · scale · log2 e − m'): one multiply-add and one ex2.
    const float scale2 = (float)(scale_d * 1.4426950408889634);
    const long long row = warp_row();
    if (row >= rows) return;
    const int lane = threadIdx.x & 31;
    const long long qi = row % q_len, bh = row / q_len, hi = bh % heads, bi = bh / heads;
    T* r = s + bi * s_b + hi * s_h + qi * s_q;
    const long long m_row = bi * m_b + hi * m_h + qi * m_q;
    const long long last_visible = causal ? qi + (k_len - q_len) : k_len - 1;
    const int n = Vec16<T>::N;
    const bool vec = vector_rows(s, k_len, s_q) && s_h % n == 0 && s_b % n == 0;
    if (vec && k_len <= 32LL * n * ROW_VECS) {
        // The row in registers as raw sixteen-byte vectors (4 registers each, where unpacked
        // floats would take n): fewer registers, more warps in flight.
        uint4 raw[ROW_VECS];
        unsigned int hid[ROW_VECS];
        float mx = NEG_INF;
#pragma unroll
        for (int c = 0; c < ROW_VECS; c++) {
            const long long j0 = ((long long)c * 32 + lane) * n;
            hid[c] = (1u << n) - 1u;
            if (j0 >= k_len) continue;
            hid[c] = hidden_bits<T>(mask, mask_bytes, m_row, m_k, j0, last_visible);
            if (hid[c] == (1u << n) - 1u) continue;
            raw[c] = *(const uint4*)(r + j0);
        }
#pragma unroll
        for (int c = 0; c < ROW_VECS; c++) {
            if (hid[c] == (1u << n) - 1u) continue;
            float v[Vec16<T>::N];
            Vec16<T>::unpack(raw[c], v);
#pragma unroll
            for (int k = 0; k < n; k++)
                if (!((hid[c] >> k) & 1u)) mx = fmaxf(mx, v[k] * scale2);
        }
        mx = warp_reduce(mx, true);
        float sum = 0.0f;
#pragma unroll
        for (int c = 0; c < ROW_VECS; c++) {
            if (hid[c] == (1u << n) - 1u) continue;
            float v[Vec16<T>::N];
            Vec16<T>::unpack(raw[c], v);
#pragma unroll
            for (int k = 0; k < n; k++)
                if (!((hid[c] >> k) & 1u)) sum += exp2f(fmaf(v[k], scale2, -mx));
        }
        sum = warp_reduce(sum, false);
        const float inv = (mx == NEG_INF || sum == 0.0f) ? 0.0f : 1.0f / sum;
#pragma unroll
        for (int c = 0; c < ROW_VECS; c++) {
            const long long j0 = ((long long)c * 32 + lane) * n;
            if (j0 >= k_len) continue;
            float v[Vec16<T>::N];
            if (hid[c] != (1u << n) - 1u) Vec16<T>::unpack(raw[c], v);
#pragma unroll
            for (int k = 0; k < n; k++) v[k] = ((hid[c] >> k) & 1u) ? 0.0f : exp2f(fmaf(v[k], scale2, -mx)) * inv;
            Vec16<T>::store(r, j0, v);
        }
        return;
    }
    // Long or unaligned rows: element by element, three passes.
    float mx = NEG_INF;
    for (long long j = lane; j < k_len; j += 32) {
        if (j <= last_visible && !hidden(mask, mask_bytes, m_row + j * m_k)) mx = fmaxf(mx, load(r, j) * scale);
    }
    mx = warp_reduce(mx, true);
    float sum = 0.0f;
    for (long long j = lane; j < k_len; j += 32) {
        if (j <= last_visible && !hidden(mask, mask_bytes, m_row + j * m_k)) sum += __expf(load(r, j) * scale - mx);
    }
    sum = warp_reduce(sum, false);
    const float inv = (mx == NEG_INF || sum == 0.0f) ? 0.0f : 1.0f / sum;
    for (long long j = lane; j < k_len; j += 32) {
        const bool visible = j <= last_visible && !hidden(mask, mask_bytes, m_row + j * m_k);
        store(r, j, visible ? __expf(load(r, j) * scale - mx) * inv : 0.0f);
    }
}

// In place: dP -> dS = P * (dP - D) * scale, where D = sum over the head dimension of
// dO * O for the row (equal to the row sum of dP * P).
template <typename T>
__device__ void grad_scores(T* dp, const T* p, const T* dout, const T* out, long long rows, long long heads,
                            long long q_len, long long k_len, long long dim, long long dp_b,
                            long long dp_h, long long dp_q, long long p_b, long long p_h,
                            long long p_q, long long g_b, long long g_h, long long g_q,
                            long long g_d, long long o_b, long long o_h, long long o_q,
                            long long o_d, double scale_d) {
    const float scale = (float)scale_d;
    const long long row = warp_row();
    if (row >= rows) return;
    const int lane = threadIdx.x & 31;
    const long long qi = row % q_len, bh = row / q_len, hi = bh % heads, bi = bh / heads;
    const T* g = dout + bi * g_b + hi * g_h + qi * g_q;
    const T* o = out + bi * o_b + hi * o_h + qi * o_q;
    float d = 0.0f;
    for (long long i = lane; i < dim; i += 32) d += load(g, i * g_d) * load(o, i * o_d);
    d = warp_reduce(d, false);
    T* dr = dp + bi * dp_b + hi * dp_h + qi * dp_q;
    const T* pr = p + bi * p_b + hi * p_h + qi * p_q;
    const int n = Vec16<T>::N;
    if (vector_rows((const T*)dp, k_len, dp_q) && dp_h % n == 0 && dp_b % n == 0 && vector_rows(p, k_len, p_q) && p_h % n == 0 &&
        p_b % n == 0) {
        float a[Vec16<T>::N], b[Vec16<T>::N];
        for (long long j = (long long)lane * n; j < k_len; j += 32LL * n) {
            Vec16<T>::load(pr, j, a);
            Vec16<T>::load(dr, j, b);
#pragma unroll
            for (int k = 0; k < n; k++) b[k] = a[k] * (b[k] - d) * scale;
            Vec16<T>::store(dr, j, b);
        }
        return;
    }
    for (long long j = lane; j < k_len; j += 32) {
        store(dr, j, load(pr, j) * (load(dr, j) - d) * scale);
    }
}

#define SOFTMAX_ARGS                                                                                     \
    const unsigned char *mask, long long rows, long long heads, long long q_len, long long k_len, long long s_b, \
        long long s_h, long long s_q, long long mask_bytes, long long m_b, long long m_h,                  \
        long long m_q, long long m_k, long long causal, double scale
#define SOFTMAX_PASS mask, rows, heads, q_len, k_len, s_b, s_h, s_q, mask_bytes, m_b, m_h, m_q, m_k, causal, scale

extern "C" __global__ void softmax_rows_f32(float* s, SOFTMAX_ARGS) { softmax_rows<float>(s, SOFTMAX_PASS); }
extern "C" __global__ void softmax_rows_bf16(bf16_t* s, SOFTMAX_ARGS) { softmax_rows<bf16_t>(s, SOFTMAX_PASS); }

#define GRAD_ARGS                                                                              \
    long long rows, long long heads, long long q_len, long long k_len, long long dim, long long dp_b, \
        long long dp_h, long long dp_q, long long p_b, long long p_h, long long p_q,           \
        long long g_b, long long g_h, long long g_q, long long g_d, long long o_b, long long o_h, \
        long long o_q, long long o_d, double scale
#define GRAD_PASS rows, heads, q_len, k_len, dim, dp_b, dp_h, dp_q, p_b, p_h, p_q, g_b, g_h, g_q, g_d, o_b, o_h, o_q, o_d, scale

extern "C" __global__ void grad_scores_f32(float* dp, const float* p, const float* dout, const float* out, GRAD_ARGS) {
    grad_scores<float>(dp, p, dout, out, GRAD_PASS);
}
extern "C" __global__ void grad_scores_bf16(bf16_t* dp, const bf16_t* p, const bf16_t* dout, const bf16_t* out, GRAD_ARGS) {
    grad_scores<bf16_t>(dp, p, dout, out, GRAD_PASS);
}
