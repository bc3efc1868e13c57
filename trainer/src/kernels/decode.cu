// The decode step's own kernels (decode.rs): one new token per row, every layer's work queued
// by one host call. RMSNorm, the SwiGLU gate and the products come from norm.cu, swiglu.cu and
// cuBLAS; these are the steps that are specific to a decode step.
//
// Layouts: activations are contiguous rows `[b, width]`; a layer's key and value storage is
// `[b, kv_heads, capacity, head_dim]` with element strides (b, head, slot) and unit stride
// along head_dim; `valid` `[b, s]` holds one flag per cached slot (the burn Bool tensor: `elem`
// bytes per flag, non-zero where the slot holds a real token), the new token's slot last.

template <typename T> __device__ __forceinline__ float round_to(float v);
template <> __device__ __forceinline__ float round_to<float>(float v) { return v; }
template <> __device__ __forceinline__ float round_to<bf16_t>(float v) { return bf16_to_f32(f32_to_bf16(v)); }

// Row `r` of the embedding table for each row's token: one block per row.
template <typename T>
__device__ void embed(const T* table, const int* tokens, T* x, long long width, long long vocab) {
    const long long r = blockIdx.x;
    long long tok = tokens[r];
    if (tok < 0 || tok >= vocab) tok = 0;  // out-of-range ids never reach here; never read past the table
    const T* src = table + tok * width;
    T* dst = x + r * width;
    for (long long j = threadIdx.x; j < width; j += blockDim.x) dst[j] = src[j];
}

// Position of each row's new token: the real tokens before it. One block per row.
__device__ void positions(const unsigned char* valid, int* pos, long long s, long long row, long long elem) {
    const long long r = blockIdx.x;
    float n = 0.0f;
    for (long long j = threadIdx.x; j < s - 1; j += blockDim.x) n += valid[r * row + j * elem] != 0 ? 1.0f : 0.0f;
    n = block_reduce(n, false);
    if (threadIdx.x == 0) pos[r] = (int)n;
}

// The projection's output `[b, (h + 2 kvh) · d]` (queries, keys, values by head) plus the
// bias, rounded to T as a separate addition would round it; queries and keys rotated by the
// row's position (rotate-half form, the tables' rows `[positions, d]`), queries written to `q`
// `[b, h, d]`, keys and values into the storage's slot `slot`. One thread per pair
// (i, i + d/2) of a head.
template <typename T>
__device__ void qkv_rotate_store(const T* qkv, const T* bias, const T* cs, const T* sn, const int* pos, T* q, T* ks, T* vs,
                                 long long b, long long h, long long kvh, long long half, long long slot, long long k_b,
                                 long long k_h, long long k_s, long long v_b, long long v_h, long long v_s) {
    const long long heads = h + 2 * kvh, d = 2 * half;
    const long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= b * heads * half) return;
    const long long i = e % half, rh = e / half, hh = rh % heads, bi = rh / heads;
    const T* src = qkv + bi * heads * d + hh * d;
    float a = load(src, i), c = load(src, i + half);
    if (bias != nullptr) {
        a = round_to<T>(a + load(bias, hh * d + i));
        c = round_to<T>(c + load(bias, hh * d + i + half));
    }
    if (hh < h + kvh) {
        const long long p = pos[bi];
        const float c1 = load(cs, p * d + i), s1 = load(sn, p * d + i);
        const float c2 = load(cs, p * d + i + half), s2 = load(sn, p * d + i + half);
        const float y0 = a * c1 - c * s1, y1 = c * c2 + a * s2;
        T* dst = hh < h ? q + (bi * h + hh) * d : ks + bi * k_b + (hh - h) * k_h + slot * k_s;
        store(dst, i, y0);
        store(dst, i + half, y1);
    } else {
        T* dst = vs + bi * v_b + (hh - h - kvh) * v_h + slot * v_s;
        store(dst, i, a);
        store(dst, i + half, c);
    }
}

// Decode attention, one block per (row, key head, split of the keys): the `groups` query
// heads that read one key head are handled together, so each key and value is read once.
// Keys are taken a chunk of blockDim.x at a time, one key per thread (its scores for every
// query head of the group), with an online softmax across chunks. With one split the output
// `[b, h, d]` is written here; with several, each split's (max, sum, weighted values) go to
// `partial` `[b · kvh, splits, groups, d + 2]` for `combine`.
#define MAXG 8
#define MAXD 256
template <typename T>
__device__ void attention(const T* q, const T* ks, const T* vs, const unsigned char* valid, T* out, float* partial, long long s,
                          long long kvh, long long groups, long long d, long long k_b, long long k_h, long long k_s, long long v_b,
                          long long v_h, long long v_s, long long valid_row, long long valid_elem, long long splits, double scale) {
    __shared__ float qs[MAXG * MAXD];
    __shared__ float sc[MAXG * MAXD];
    __shared__ float red[MAXG * 8];
    const int t = threadIdx.x, lane = t & 31, warp = t >> 5, nw = blockDim.x >> 5;
    const long long split = blockIdx.x % splits, bh = blockIdx.x / splits;
    const long long bi = bh / kvh, kh = bh % kvh;
    const long long G = groups, h = kvh * groups;
    const T* qrow = q + (bi * h + kh * G) * d;
    for (long long e = t; e < G * d; e += blockDim.x) qs[e] = load(qrow, e) * (float)scale;
    __syncthreads();
    const long long per = (s + splits - 1) / splits;
    const long long lo = split * per, hi = min(s, lo + per);
    const T* kb = ks + bi * k_b + kh * k_h;
    const T* vb = vs + bi * v_b + kh * v_h;
    const long long dd = t % d, part = t / d, parts = blockDim.x / d;
    const int n16 = Vec16<T>::N;
    const bool vec = vector_rows(kb, d, k_s) && k_b % n16 == 0 && k_h % n16 == 0;
    float m[MAXG], l[MAXG], acc[MAXG];
#pragma unroll
    for (int g = 0; g < MAXG; g++) {
        m[g] = NEG_INF;
        l[g] = 0.0f;
        acc[g] = 0.0f;
    }
    for (long long c0 = lo; c0 < hi; c0 += blockDim.x) {
        const long long n = min((long long)blockDim.x, hi - c0);
        float sg[MAXG];
#pragma unroll
        for (int g = 0; g < MAXG; g++) sg[g] = NEG_INF;
        const long long j = c0 + t;
        if (t < n && valid[bi * valid_row + j * valid_elem] != 0) {
            float dot[MAXG];
#pragma unroll
            for (int g = 0; g < MAXG; g++) dot[g] = 0.0f;
            const T* kr = kb + j * k_s;
            if (vec) {
                float kv[Vec16<T>::N];
#pragma unroll 4
                for (long long k = 0; k < d; k += n16) {
                    Vec16<T>::load(kr, k, kv);
#pragma unroll
                    for (int u = 0; u < Vec16<T>::N; u++) {
#pragma unroll
                        for (int g = 0; g < MAXG; g++)
                            if (g < G) dot[g] += qs[g * d + k + u] * kv[u];
                    }
                }
            } else {
                for (long long k = 0; k < d; k++) {
                    const float kv = load(kr, k);
#pragma unroll
                    for (int g = 0; g < MAXG; g++)
                        if (g < G) dot[g] += qs[g * d + k] * kv;
                }
            }
#pragma unroll
            for (int g = 0; g < MAXG; g++) sg[g] = dot[g];
        }
        // Each head's maximum over the chunk.
        float cm[MAXG];
#pragma unroll
        for (int g = 0; g < MAXG; g++) {
            const float w = warp_reduce(sg[g], true);
            if (lane == 0 && g < G) red[g * nw + warp] = w;
        }
        __syncthreads();
#pragma unroll
        for (int g = 0; g < MAXG; g++) {
            cm[g] = NEG_INF;
            if (g < G)
                for (int w = 0; w < nw; w++) cm[g] = fmaxf(cm[g], red[g * nw + w]);
        }
        __syncthreads();
        float corr[MAXG], p[MAXG];
#pragma unroll
        for (int g = 0; g < MAXG; g++) {
            const float mn = fmaxf(m[g], cm[g]);
            p[g] = sg[g] == NEG_INF ? 0.0f : __expf(sg[g] - mn);
            corr[g] = m[g] == NEG_INF ? 0.0f : __expf(m[g] - mn);
            m[g] = mn;
            if (g < G) sc[g * blockDim.x + t] = p[g];
        }
#pragma unroll
        for (int g = 0; g < MAXG; g++) {
            const float w = warp_reduce(p[g], false);
            if (lane == 0 && g < G) red[g * nw + warp] = w;
        }
        __syncthreads();
#pragma unroll
        for (int g = 0; g < MAXG; g++) {
            float sum = 0.0f;
            if (g < G)
                for (int w = 0; w < nw; w++) sum += red[g * nw + w];
            l[g] = l[g] * corr[g] + sum;
            acc[g] *= corr[g];
        }
        // Eight values loaded before any is used: one wait on memory per eight keys, not per
        // key (the sums keep their order).
        long long jj = part;
        for (; jj + 7 * parts < n; jj += 8 * parts) {
            float vv[8];
#pragma unroll
            for (int u = 0; u < 8; u++) vv[u] = load(vb + (c0 + jj + u * parts) * v_s, dd);
#pragma unroll
            for (int u = 0; u < 8; u++) {
#pragma unroll
                for (int g = 0; g < MAXG; g++)
                    if (g < G) acc[g] += sc[g * blockDim.x + jj + u * parts] * vv[u];
            }
        }
        for (; jj < n; jj += parts) {
            const float vv = load(vb + (c0 + jj) * v_s, dd);
#pragma unroll
            for (int g = 0; g < MAXG; g++)
                if (g < G) acc[g] += sc[g * blockDim.x + jj] * vv;
        }
        __syncthreads();  // sc and red are rewritten by the next chunk
    }
    // The parts of each dimension's sum, added up.
#pragma unroll
    for (int g = 0; g < MAXG; g++)
        if (g < G) sc[(part * G + g) * d + dd] = acc[g];
    __syncthreads();
    if (part != 0) return;
#pragma unroll
    for (int g = 0; g < MAXG; g++) {
        if (g >= G) continue;
        float total = 0.0f;
        for (long long pp = 0; pp < parts; pp++) total += sc[(pp * G + g) * d + dd];
        if (splits == 1) {
            store(out + (bi * h + kh * G + g) * d, dd, l[g] > 0.0f ? total / l[g] : 0.0f);
        } else {
            float* slot = partial + ((bh * splits + split) * G + g) * (d + 2);
            slot[dd] = total;
            if (dd == 0) {
                slot[d] = m[g];
                slot[d + 1] = l[g];
            }
        }
    }
}

// The splits of `attention` merged: one block per (row, query head), one thread per
// dimension.
template <typename T>
__device__ void combine(const float* partial, T* out, long long kvh, long long groups, long long d, long long splits) {
    const long long bhg = blockIdx.x, g = bhg % groups, bh = bhg / groups;
    const long long bi = bh / kvh, kh = bh % kvh, h = kvh * groups;
    const long long dd = threadIdx.x;
    if (dd >= d) return;
    float mx = NEG_INF;
    for (long long sp = 0; sp < splits; sp++) mx = fmaxf(mx, partial[((bh * splits + sp) * groups + g) * (d + 2) + d]);
    float num = 0.0f, den = 0.0f;
    for (long long sp = 0; sp < splits; sp++) {
        const float* slot = partial + ((bh * splits + sp) * groups + g) * (d + 2);
        if (slot[d] == NEG_INF) continue;  // every key of this split was padding
        const float w = __expf(slot[d] - mx);
        num += slot[dd] * w;
        den += slot[d + 1] * w;
    }
    store(out + (bi * h + kh * groups + g) * d, dd, den > 0.0f ? num / den : 0.0f);
}

#define EMBED_ARGS long long width, long long vocab
extern "C" __global__ void embed_f32(const float* table, const int* tokens, float* x, EMBED_ARGS) { embed<float>(table, tokens, x, width, vocab); }
extern "C" __global__ void embed_bf16(const bf16_t* table, const int* tokens, bf16_t* x, EMBED_ARGS) { embed<bf16_t>(table, tokens, x, width, vocab); }

extern "C" __global__ void decode_positions(const unsigned char* valid, int* pos, long long s, long long row, long long elem) {
    positions(valid, pos, s, row, elem);
}

#define QKV_ARGS                                                                                                         \
    long long b, long long h, long long kvh, long long half, long long slot, long long k_b, long long k_h, long long k_s, \
        long long v_b, long long v_h, long long v_s
#define QKV_PASS b, h, kvh, half, slot, k_b, k_h, k_s, v_b, v_h, v_s
extern "C" __global__ void qkv_f32(const float* qkv, const float* bias, const float* cs, const float* sn, const int* pos, float* q,
                                   float* ks, float* vs, QKV_ARGS) {
    qkv_rotate_store<float>(qkv, bias, cs, sn, pos, q, ks, vs, QKV_PASS);
}
extern "C" __global__ void qkv_bf16(const bf16_t* qkv, const bf16_t* bias, const bf16_t* cs, const bf16_t* sn, const int* pos,
                                    bf16_t* q, bf16_t* ks, bf16_t* vs, QKV_ARGS) {
    qkv_rotate_store<bf16_t>(qkv, bias, cs, sn, pos, q, ks, vs, QKV_PASS);
}

#define ATTN_ARGS                                                                                                                 \
    long long s, long long kvh, long long groups, long long d, long long k_b, long long k_h, long long k_s, long long v_b,         \
        long long v_h, long long v_s, long long valid_row, long long valid_elem, long long splits, double scale
#define ATTN_PASS s, kvh, groups, d, k_b, k_h, k_s, v_b, v_h, v_s, valid_row, valid_elem, splits, scale
extern "C" __global__ void attention_f32(const float* q, const float* ks, const float* vs, const unsigned char* valid, float* out,
                                         float* partial, ATTN_ARGS) {
    attention<float>(q, ks, vs, valid, out, partial, ATTN_PASS);
}
extern "C" __global__ void attention_bf16(const bf16_t* q, const bf16_t* ks, const bf16_t* vs, const unsigned char* valid,
                                          bf16_t* out, float* partial, ATTN_ARGS) {
    attention<bf16_t>(q, ks, vs, valid, out, partial, ATTN_PASS);
}

extern "C" __global__ void combine_f32(const float* partial, float* out, long long kvh, long long groups, long long d, long long splits) {
    combine<float>(partial, out, kvh, groups, d, splits);
}
extern "C" __global__ void combine_bf16(const float* partial, bf16_t* out, long long kvh, long long groups, long long d, long long splits) {
    combine<bf16_t>(partial, out, kvh, groups, d, splits);
}
