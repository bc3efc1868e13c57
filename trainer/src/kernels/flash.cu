// Flash attention for the trainer's bf16 CUDA path (trainer/src/kernels/flash.rs): tiles of
// 64 queries against tiles of 64 keys in shared memory, the scores only ever in registers
// (FlashAttention-2). Products on the tensor cores (mma.sync m16n8k16, bf16 in, f32
// accumulate); head widths 64 and 128; grouped-query attention read in place (query head j
// reads key head j / (heads / kv_heads)); a boolean mask (true = hidden, any strides, one
// byte per element) and/or causality aligned at the bottom right.
//
//   flash_fwd:    O = softmax(Q Kᵗ · scale, masked) V, and per row the log2-sum-exp2 of the
//                 scaled scores (+inf where every key is hidden: such rows get zeros).
//   flash_stats:  the backward's row statistics: the log2-sum-exp2 recomputed (the autodiff
//                 hook keeps only Q, K, V and O), D = rowsum(dO ∘ O), dQ's f32 accumulator
//                 zeroed.
//   flash_bwd:    one block per (key tile, query head): dK, dV of its keys over every query
//                 tile in registers (f32, written per query head), dQ added into the f32
//                 accumulator with atomics.
//   flash_finish: dQ to the element type; dK, dV summed over each key head's query heads.
//
// A tile whose mask hides every pair is skipped whole (the future half of a causal mask).

#define FA_B 64         // queries per query tile, keys per key tile
#define FA_THREADS 128  // four warps, sixteen rows each

__device__ __forceinline__ unsigned smem_u32(const void* p) {
    unsigned r;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(r) : "l"(p));
    return r;
}

__device__ __forceinline__ void ldsm_x4(unsigned* r, const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_u32(p)));
}

__device__ __forceinline__ void ldsm_x4_t(unsigned* r, const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_u32(p)));
}

// c += a · b: a 16x16 (row-major fragment), b 16x8 (column-major fragment), c 16x8 f32.
__device__ __forceinline__ void mma(float* c, const unsigned* a, unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Fragment addresses, for a tile stored row by row with `ld` elements per row:
// A (16 x 16 at row r0, column c0) stored row-major [m][k].
__device__ __forceinline__ const bf16_t* a_addr(const bf16_t* s, int ld, int r0, int c0, int lane) {
    return s + (r0 + (lane & 15)) * ld + c0 + (lane >> 4) * 8;
}
// A stored transposed ([k][m]: rows k0.., columns m0..), read with ldsm_x4_t.
__device__ __forceinline__ const bf16_t* at_addr(const bf16_t* s, int ld, int k0, int m0, int lane) {
    return s + (k0 + (lane & 7) + (lane >> 4) * 8) * ld + m0 + ((lane >> 3) & 1) * 8;
}
// Two n-tiles of B (n0..n0+15, k0..k0+15) stored n-major ([n][k]): b of n-tile 0 = r[0], r[1];
// of n-tile 1 = r[2], r[3].
__device__ __forceinline__ const bf16_t* b_addr(const bf16_t* s, int ld, int n0, int k0, int lane) {
    return s + (n0 + (lane & 7) + (lane >> 4) * 8) * ld + k0 + ((lane >> 3) & 1) * 8;
}
// Two n-tiles of B stored k-major ([k][n]), read with ldsm_x4_t; same register order.
__device__ __forceinline__ const bf16_t* bt_addr(const bf16_t* s, int ld, int k0, int n0, int lane) {
    return s + (k0 + (lane & 7) + ((lane >> 3) & 1) * 8) * ld + n0 + (lane >> 4) * 8;
}

// Rows [r0, r0 + 64) of a [rows, D] operand (row stride `rs` elements, unit column stride) into
// shared memory, `ld` elements per row; rows past `rows` as zeros. Asynchronous copies, all in
// flight at once: the caller waits with `cp_wait` before its barrier.
template <int D>
__device__ __forceinline__ void load_tile(bf16_t* dst, int ld, const bf16_t* src, long long rs, long long r0, long long rows) {
    const int per_row = D / 8;
#pragma unroll
    for (int it = 0; it < FA_B * per_row / FA_THREADS; it++) {
        const int i = threadIdx.x + it * FA_THREADS;
        const int r = i / per_row, c = (i % per_row) * 8;
        const bool in = r0 + r < rows;
        const bf16_t* from = in ? src + (r0 + r) * rs + c : src;
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_u32(dst + r * ld + c)), "l"(from),
                     "r"(in ? 16 : 0));
    }
}

__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_all;" ::: "memory"); }

// The mask's [64 x 64] tile of queries q0.. and keys k0.. as bytes, 1 = hidden (by the mask,
// causality, or lying past the queries or keys). `mrow` addresses query q0's row of this batch
// and head. Sets `any_visible` and `any_hidden` (this thread's share).
__device__ __forceinline__ void mask_tile(unsigned char* sm, const unsigned char* mrow, long long m_q, long long m_k,
                                          long long q0, long long k0, long long t, long long s, long long causal,
                                          int& any_visible, int& any_hidden) {
    const long long shift = s - t;
    // Whole rows of four aligned bytes: every load issued before any is used.
    const bool fast = mrow && m_k == 1 && (m_q & 3) == 0 && (((unsigned long long)(mrow + k0)) & 3) == 0 &&
                      q0 + FA_B <= t && k0 + FA_B <= s;
    if (fast) {
        unsigned int w[FA_B * FA_B / 4 / FA_THREADS];
#pragma unroll
        for (int it = 0; it < FA_B * FA_B / 4 / FA_THREADS; it++) {
            const int i = threadIdx.x + it * FA_THREADS;
            const int r = i / (FA_B / 4), c = (i % (FA_B / 4)) * 4;
            w[it] = *(const unsigned int*)(mrow + r * m_q + k0 + c);
        }
#pragma unroll
        for (int it = 0; it < FA_B * FA_B / 4 / FA_THREADS; it++) {
            const int i = threadIdx.x + it * FA_THREADS;
            const int r = i / (FA_B / 4), c = (i % (FA_B / 4)) * 4;
            unsigned int bits = 0;
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const bool hid = ((w[it] >> (8 * e)) & 0xffu) != 0 || (causal && k0 + c + e > q0 + r + shift);
                bits |= (hid ? 1u : 0u) << (8 * e);
                any_hidden |= hid ? 1 : 0;
                any_visible |= hid ? 0 : 1;
            }
            if (sm) *(unsigned int*)(sm + r * FA_B + c) = bits;
        }
        return;
    }
    for (int i = threadIdx.x; i < FA_B * FA_B / 4; i += FA_THREADS) {
        const int r = i / (FA_B / 4), c = (i % (FA_B / 4)) * 4;
        const long long qi = q0 + r;
        unsigned int bits = 0;
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const long long kj = k0 + c + e;
            bool hid = qi >= t || kj >= s || (causal && kj > qi + shift);
            if (!hid && mrow) hid = mrow[r * m_q + kj * m_k] != 0;
            bits |= (hid ? 1u : 0u) << (8 * e);
            any_hidden |= hid ? 1 : 0;
            any_visible |= hid ? 0 : 1;
        }
        if (sm) *(unsigned int*)(sm + r * FA_B + c) = bits;
    }
}

// Per 64 x 64 tile of (query, key) pairs of each batch row (and head, where the mask varies
// by head): 0 every pair hidden (skipped), 1 every pair visible (no mask read), 2 mixed (the
// mask tile read). One block per tile; `classes` is [b, mask heads, query tiles, key tiles].
extern "C" __global__ void __launch_bounds__(FA_THREADS) flash_classes(
    unsigned char* classes, const unsigned char* mask, long long mask_heads, long long t, long long s, long long m_b,
    long long m_h, long long m_q, long long m_k, long long causal) {
    const long long nqt = (t + FA_B - 1) / FA_B, nkt = (s + FA_B - 1) / FA_B;
    long long idx = blockIdx.x;
    const long long kt = idx % nkt;
    idx /= nkt;
    const long long qt = idx % nqt;
    idx /= nqt;
    const long long hm = idx % mask_heads, bi = idx / mask_heads;
    const unsigned char* mrow = mask ? mask + bi * m_b + hm * m_h + qt * FA_B * m_q : nullptr;
    int vis = 0, hid = 0;
    mask_tile(nullptr, mrow, m_q, m_k, qt * FA_B, kt * FA_B, t, s, causal, vis, hid);
    vis = __syncthreads_or(vis);
    hid = __syncthreads_or(hid);
    if (threadIdx.x == 0) classes[blockIdx.x] = !vis ? 0 : (hid ? 2 : 1);
}

struct FlashArgs {
    long long heads, kv_heads, t, s;
    long long q_b, q_h, q_t;  // element strides of Q (the head dimension is unit-stride)
    long long k_b, k_h, k_t;
    long long v_b, v_h, v_t;
    long long m_b, m_h, m_q, m_k;  // mask strides
    long long causal;
    float scale2;  // scale · log2 e
    const unsigned char* classes;  // flash_classes' output
    long long class_heads;         // 1 when the mask is shared by the heads, else heads
};

// The class of query tile qt against key tile kt for batch row bi, head hi.
__device__ __forceinline__ int tile_class(const FlashArgs& a, long long bi, long long hi, long long qt, long long kt) {
    const long long nqt = (a.t + FA_B - 1) / FA_B, nkt = (a.s + FA_B - 1) / FA_B;
    const long long hm = a.class_heads == 1 ? 0 : hi;
    return a.classes[((bi * a.class_heads + hm) * nqt + qt) * nkt + kt];
}

// Forward (STATS false) or the backward's statistics (STATS true: no O, but D and dQ zeroed).
template <int D, bool STATS>
__device__ void flash_fwd(const bf16_t* __restrict__ q, const bf16_t* __restrict__ k, const bf16_t* __restrict__ v,
                          const unsigned char* __restrict__ mask, bf16_t* __restrict__ o, float* __restrict__ lse,
                          const bf16_t* __restrict__ dout, float* __restrict__ delta, float* __restrict__ dq_acc,
                          const FlashArgs a) {
    constexpr int LD = D + 8;  // a sixteen-byte pad per row: ldmatrix's eight rows hit distinct banks
    __shared__ __align__(16) bf16_t sk[FA_B * LD];
    __shared__ __align__(16) bf16_t sv[STATS ? 8 : FA_B * LD];
    __shared__ __align__(16) unsigned char sm[FA_B * FA_B];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
    const long long nqt = (a.t + FA_B - 1) / FA_B;
    // Heads vary fastest: blocks in flight share the mask tile and (within a group) K and V.
    long long idx = blockIdx.x;
    const long long hi = idx % a.heads;
    idx /= a.heads;
    const long long qt = nqt - 1 - idx % nqt;  // the longest rows (causal) first
    const long long bi = idx / nqt;
    const long long kv = hi / (a.heads / a.kv_heads);
    const long long q0 = qt * FA_B;
    const bf16_t* qp = q + bi * a.q_b + hi * a.q_h;
    const bf16_t* kp = k + bi * a.k_b + kv * a.k_h;
    const bf16_t* vp = v + bi * a.v_b + kv * a.v_h;
    const unsigned char* mrow = mask ? mask + bi * a.m_b + hi * a.m_h + q0 * a.m_q : nullptr;
    const long long row_base = (bi * a.heads + hi) * a.t;  // rows of O, lse, D: [b, h, t] contiguous

    if (STATS) {
        // D = rowsum(dO ∘ O) for this tile's rows (O and dO contiguous [b, h, t, D]); dQ's
        // accumulator rows zeroed.
        for (int r = warp; r < FA_B; r += FA_THREADS / 32) {
            const long long qi = q0 + r;
            if (qi >= a.t) break;
            const long long at = (row_base + qi) * D;
            float d = 0.0f;
            for (int c = lane; c < D; c += 32) {
                d += load(dout, at + c) * load(o, at + c);
                dq_acc[at + c] = 0.0f;
            }
            d = warp_reduce(d, false);
            if (lane == 0) delta[row_base + qi] = d;
        }
    }

    // This warp's sixteen query rows as A fragments.
    load_tile<D>(sk, LD, qp, a.q_t, q0, a.t);
    cp_wait();
    __syncthreads();
    unsigned qf[D / 16][4];
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++) ldsm_x4(qf[kk], a_addr(sk, LD, warp * 16, kk * 16, lane));

    float oacc[STATS ? 1 : D / 8][4];
    if (!STATS) {
#pragma unroll
        for (int j = 0; j < D / 8; j++) oacc[j][0] = oacc[j][1] = oacc[j][2] = oacc[j][3] = 0.0f;
    }
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.0f, 0.0f};

    long long k_end = a.s;
    if (a.causal) {
        const long long last = q0 + FA_B - 1 + a.s - a.t + 1;  // keys up to the tile's last row's
        k_end = last < k_end ? last : k_end;
    }
    for (long long k0 = 0; k0 < k_end; k0 += FA_B) {
        const int cls = tile_class(a, bi, hi, qt, k0 / FA_B);
        if (cls == 0) continue;
        __syncthreads();  // the previous tile's readers are done
        load_tile<D>(sk, LD, kp, a.k_t, k0, a.s);
        if (!STATS) load_tile<D>(sv, LD, vp, a.v_t, k0, a.s);
        if (cls == 2) {
            int vis = 0, hid = 0;
            mask_tile(sm, mrow, a.m_q, a.m_k, q0, k0, a.t, a.s, a.causal, vis, hid);
        }
        cp_wait();
        __syncthreads();

        float sacc[8][4];
#pragma unroll
        for (int j = 0; j < 8; j++) sacc[j][0] = sacc[j][1] = sacc[j][2] = sacc[j][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++) {
#pragma unroll
            for (int p = 0; p < 4; p++) {
                unsigned b[4];
                ldsm_x4(b, b_addr(sk, LD, p * 16, kk * 16, lane));
                mma(sacc[2 * p], qf[kk], b[0], b[1]);
                mma(sacc[2 * p + 1], qf[kk], b[2], b[3]);
            }
        }
        // Online softmax, base 2; rows g and g + 8 of the warp's sixteen.
        float mx[2] = {m[0], m[1]};
#pragma unroll
        for (int j = 0; j < 8; j++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int r = warp * 16 + g + (e >> 1) * 8, c = j * 8 + 2 * tq + (e & 1);
                const float x = cls == 2 && sm[r * FA_B + c] ? NEG_INF : sacc[j][e] * a.scale2;
                sacc[j][e] = x;
                mx[e >> 1] = fmaxf(mx[e >> 1], x);
            }
        }
        float alpha[2], mu[2];
#pragma unroll
        for (int i = 0; i < 2; i++) {
            mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 1));
            mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 2));
            mu[i] = mx[i] == NEG_INF ? 0.0f : mx[i];  // all hidden so far: exp2(-inf - 0) = 0
            alpha[i] = exp2f(m[i] - mu[i]);
            m[i] = mx[i];
            l[i] *= alpha[i];
        }
#pragma unroll
        for (int j = 0; j < 8; j++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const float p = exp2f(sacc[j][e] - mu[e >> 1]);
                sacc[j][e] = p;
                l[e >> 1] += p;
            }
        }
        if (!STATS) {
#pragma unroll
            for (int j = 0; j < D / 8; j++) {
                oacc[j][0] *= alpha[0];
                oacc[j][1] *= alpha[0];
                oacc[j][2] *= alpha[1];
                oacc[j][3] *= alpha[1];
            }
            // O += P V: P's accumulators are already A fragments, sixteen keys a step.
#pragma unroll
            for (int kk = 0; kk < 4; kk++) {
                unsigned pa[4] = {f32x2_to_bf16x2(sacc[2 * kk][0], sacc[2 * kk][1]),
                                  f32x2_to_bf16x2(sacc[2 * kk][2], sacc[2 * kk][3]),
                                  f32x2_to_bf16x2(sacc[2 * kk + 1][0], sacc[2 * kk + 1][1]),
                                  f32x2_to_bf16x2(sacc[2 * kk + 1][2], sacc[2 * kk + 1][3])};
#pragma unroll
                for (int p = 0; p < D / 16; p++) {
                    unsigned b[4];
                    ldsm_x4_t(b, bt_addr(sv, LD, kk * 16, p * 16, lane));
                    mma(oacc[2 * p], pa, b[0], b[1]);
                    mma(oacc[2 * p + 1], pa, b[2], b[3]);
                }
            }
        }
    }
#pragma unroll
    for (int i = 0; i < 2; i++) {
        l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
        l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
    }
    const long long r0 = q0 + warp * 16 + g;
    if (!STATS) {
        const float inv[2] = {l[0] > 0.0f ? 1.0f / l[0] : 0.0f, l[1] > 0.0f ? 1.0f / l[1] : 0.0f};
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const long long qi = r0 + i * 8;
            if (qi >= a.t) continue;
            unsigned int* orow = (unsigned int*)(o + (row_base + qi) * D);
#pragma unroll
            for (int j = 0; j < D / 8; j++)
                orow[(j * 8 + 2 * tq) / 2] = f32x2_to_bf16x2(oacc[j][2 * i] * inv[i], oacc[j][2 * i + 1] * inv[i]);
        }
    }
    if (lse && tq == 0) {
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const long long qi = r0 + i * 8;
            if (qi < a.t) lse[row_base + qi] = l[i] > 0.0f ? m[i] + __log2f(l[i]) : __int_as_float(0x7f800000);
        }
    }
}

// Backward for one tile of 64 keys of one query head: warp w owns keys w*16 .. w*16+15.
// Dynamic shared memory: K, V, Q, dO tiles ([64][D + 8] each), dSᵀ ([64][72]), the mask
// tile, and the query tile's statistics.
template <int D>
__device__ void flash_bwd(const bf16_t* __restrict__ q, const bf16_t* __restrict__ k, const bf16_t* __restrict__ v,
                          const unsigned char* __restrict__ mask, const bf16_t* __restrict__ dout,
                          const float* __restrict__ lse, const float* __restrict__ delta, float* __restrict__ dq_acc,
                          float* __restrict__ dk_acc, float* __restrict__ dv_acc, const FlashArgs a, float scale) {
    constexpr int LD = D + 8, LDS = FA_B + 8;
    extern __shared__ __align__(16) unsigned char smem[];
    bf16_t* sk = (bf16_t*)smem;
    bf16_t* sv = sk + FA_B * LD;
    bf16_t* sq = sv + FA_B * LD;
    bf16_t* sdo = sq + FA_B * LD;
    bf16_t* sds = sdo + FA_B * LD;
    unsigned char* sm = (unsigned char*)(sds + FA_B * LDS);
    float* slse = (float*)(sm + FA_B * FA_B);
    float* sdel = slse + FA_B;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
    const long long nkt = (a.s + FA_B - 1) / FA_B;
    long long idx = blockIdx.x;
    const long long hi = idx % a.heads;
    idx /= a.heads;
    const long long kt = idx % nkt;
    const long long bi = idx / nkt;
    const long long kv = hi / (a.heads / a.kv_heads);
    const long long k0 = kt * FA_B;
    const bf16_t* qp = q + bi * a.q_b + hi * a.q_h;
    const bf16_t* kp = k + bi * a.k_b + kv * a.k_h;
    const bf16_t* vp = v + bi * a.v_b + kv * a.v_h;
    const long long row_base = (bi * a.heads + hi) * a.t;
    const bf16_t* dop = dout + row_base * D;

    load_tile<D>(sk, LD, kp, a.k_t, k0, a.s);
    load_tile<D>(sv, LD, vp, a.v_t, k0, a.s);

    float dk[D / 8][4], dv[D / 8][4];
#pragma unroll
    for (int j = 0; j < D / 8; j++) {
        dk[j][0] = dk[j][1] = dk[j][2] = dk[j][3] = 0.0f;
        dv[j][0] = dv[j][1] = dv[j][2] = dv[j][3] = 0.0f;
    }
    // Causal: queries before k0 - (s - t) see none of these keys.
    long long q_start = 0;
    if (a.causal) {
        const long long first = k0 - (a.s - a.t);
        q_start = first > 0 ? (first / FA_B) * FA_B : 0;
    }
    for (long long q0 = q_start; q0 < a.t; q0 += FA_B) {
        const int cls = tile_class(a, bi, hi, q0 / FA_B, kt);
        if (cls == 0) continue;
        __syncthreads();  // the previous tile's readers are done
        const unsigned char* mrow = mask ? mask + bi * a.m_b + hi * a.m_h + q0 * a.m_q : nullptr;
        load_tile<D>(sq, LD, qp, a.q_t, q0, a.t);
        load_tile<D>(sdo, LD, dop, D, q0, a.t);
        if (cls == 2) {
            int vis = 0, hid = 0;
            mask_tile(sm, mrow, a.m_q, a.m_k, q0, k0, a.t, a.s, a.causal, vis, hid);
        }
        for (int r = threadIdx.x; r < FA_B; r += FA_THREADS) {
            const bool in = q0 + r < a.t;
            slse[r] = in ? lse[row_base + q0 + r] : __int_as_float(0x7f800000);
            sdel[r] = in ? delta[row_base + q0 + r] : 0.0f;
        }
        cp_wait();  // K and V too, on the first tile
        __syncthreads();

        // Sᵀ (this warp's 16 keys x 64 queries) = K Qᵗ, and dPᵀ = V dOᵗ.
        float st[8][4], dpt[8][4];
#pragma unroll
        for (int j = 0; j < 8; j++) {
            st[j][0] = st[j][1] = st[j][2] = st[j][3] = 0.0f;
            dpt[j][0] = dpt[j][1] = dpt[j][2] = dpt[j][3] = 0.0f;
        }
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++) {
            unsigned ka[4], va[4];
            ldsm_x4(ka, a_addr(sk, LD, warp * 16, kk * 16, lane));
            ldsm_x4(va, a_addr(sv, LD, warp * 16, kk * 16, lane));
#pragma unroll
            for (int p = 0; p < 4; p++) {
                unsigned b[4];
                ldsm_x4(b, b_addr(sq, LD, p * 16, kk * 16, lane));
                mma(st[2 * p], ka, b[0], b[1]);
                mma(st[2 * p + 1], ka, b[2], b[3]);
                ldsm_x4(b, b_addr(sdo, LD, p * 16, kk * 16, lane));
                mma(dpt[2 * p], va, b[0], b[1]);
                mma(dpt[2 * p + 1], va, b[2], b[3]);
            }
        }
        // Pᵀ = exp2(S · scale2 − lse) where visible; dSᵀ = Pᵀ ∘ (dPᵀ − D) · scale.
#pragma unroll
        for (int j = 0; j < 8; j++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int key = warp * 16 + g + (e >> 1) * 8, qr = j * 8 + 2 * tq + (e & 1);
                const float p = cls == 2 && sm[qr * FA_B + key] ? 0.0f : exp2f(st[j][e] * a.scale2 - slse[qr]);
                st[j][e] = p;
                dpt[j][e] = p * (dpt[j][e] - sdel[qr]) * scale;
            }
        }
#pragma unroll
        for (int kk = 0; kk < 4; kk++) {
            const unsigned pa[4] = {f32x2_to_bf16x2(st[2 * kk][0], st[2 * kk][1]),
                                    f32x2_to_bf16x2(st[2 * kk][2], st[2 * kk][3]),
                                    f32x2_to_bf16x2(st[2 * kk + 1][0], st[2 * kk + 1][1]),
                                    f32x2_to_bf16x2(st[2 * kk + 1][2], st[2 * kk + 1][3])};
            const unsigned da[4] = {f32x2_to_bf16x2(dpt[2 * kk][0], dpt[2 * kk][1]),
                                    f32x2_to_bf16x2(dpt[2 * kk][2], dpt[2 * kk][3]),
                                    f32x2_to_bf16x2(dpt[2 * kk + 1][0], dpt[2 * kk + 1][1]),
                                    f32x2_to_bf16x2(dpt[2 * kk + 1][2], dpt[2 * kk + 1][3])};
            // dSᵀ to shared memory for dQ: rows of keys, columns of queries.
            unsigned int* r0 = (unsigned int*)(sds + (warp * 16 + g) * LDS + kk * 16 + 2 * tq);
            unsigned int* r8 = (unsigned int*)(sds + (warp * 16 + g + 8) * LDS + kk * 16 + 2 * tq);
            r0[0] = da[0];
            r8[0] = da[1];
            r0[4] = da[2];
            r8[4] = da[3];
            // dV += Pᵀ dO and dK += dSᵀ Q (queries kk*16.. as the reduction).
#pragma unroll
            for (int p = 0; p < D / 16; p++) {
                unsigned b[4];
                ldsm_x4_t(b, bt_addr(sdo, LD, kk * 16, p * 16, lane));
                mma(dv[2 * p], pa, b[0], b[1]);
                mma(dv[2 * p + 1], pa, b[2], b[3]);
                ldsm_x4_t(b, bt_addr(sq, LD, kk * 16, p * 16, lane));
                mma(dk[2 * p], da, b[0], b[1]);
                mma(dk[2 * p + 1], da, b[2], b[3]);
            }
        }
        __syncthreads();  // dSᵀ complete
        // dQ (warp w: queries w*16..) += dS K over the tile's 64 keys, added into the f32 sum.
        float dq[D / 8][4];
#pragma unroll
        for (int j = 0; j < D / 8; j++) dq[j][0] = dq[j][1] = dq[j][2] = dq[j][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < 4; kk++) {
            unsigned da[4];
            ldsm_x4_t(da, at_addr(sds, LDS, kk * 16, warp * 16, lane));
#pragma unroll
            for (int p = 0; p < D / 16; p++) {
                unsigned b[4];
                ldsm_x4_t(b, bt_addr(sk, LD, kk * 16, p * 16, lane));
                mma(dq[2 * p], da, b[0], b[1]);
                mma(dq[2 * p + 1], da, b[2], b[3]);
            }
        }
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const long long qi = q0 + warp * 16 + g + i * 8;
            if (qi >= a.t) continue;
            float* row = dq_acc + (row_base + qi) * D + 2 * tq;
#pragma unroll
            for (int j = 0; j < D / 8; j++) {
                atomicAdd(row + j * 8, dq[j][2 * i]);
                atomicAdd(row + j * 8 + 1, dq[j][2 * i + 1]);
            }
        }
    }
    cp_wait();  // K and V, where every query tile was skipped
    // This query head's share of dK and dV, [b, heads, s, D] in f32.
    const long long key_base = (bi * a.heads + hi) * a.s;
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const long long kj = k0 + warp * 16 + g + i * 8;
        if (kj >= a.s) continue;
        float* kr = dk_acc + (key_base + kj) * D + 2 * tq;
        float* vr = dv_acc + (key_base + kj) * D + 2 * tq;
#pragma unroll
        for (int j = 0; j < D / 8; j++) {
            *(float2*)(kr + j * 8) = make_float2(dk[j][2 * i], dk[j][2 * i + 1]);
            *(float2*)(vr + j * 8) = make_float2(dv[j][2 * i], dv[j][2 * i + 1]);
        }
    }
}

#define FWD_PARAMS                                                                                          \
    const bf16_t *q, const bf16_t *k, const bf16_t *v, bf16_t *o, const unsigned char *classes, const unsigned char *mask, long long heads, \
        long long kv_heads, long long t, long long s, long long q_b, long long q_h, long long q_t, long long k_b, \
        long long k_h, long long k_t, long long v_b, long long v_h, long long v_t, long long m_b, long long m_h, \
        long long m_q, long long m_k, long long causal, double scale, long long class_heads
#define STATS_PARAMS                                                                                        \
    const bf16_t *q, const bf16_t *k, const bf16_t *v, bf16_t *o, const bf16_t *dout, float *delta,          \
        float *dq_acc, float *lse, const unsigned char *classes, const unsigned char *mask, long long heads, long long kv_heads, long long t, \
        long long s, long long q_b, long long q_h, long long q_t, long long k_b, long long k_h, long long k_t, \
        long long v_b, long long v_h, long long v_t, long long m_b, long long m_h, long long m_q, long long m_k, \
        long long causal, double scale, long long class_heads
#define ARGS                                                                                                  \
    FlashArgs a = {heads, kv_heads, t, s, q_b, q_h, q_t, k_b, k_h, k_t, v_b, v_h, v_t, m_b, m_h, m_q, m_k, causal, \
                   (float)(scale * 1.4426950408889634), classes, class_heads}

extern "C" __global__ void __launch_bounds__(FA_THREADS) flash_fwd_64(FWD_PARAMS) {
    ARGS;
    flash_fwd<64, false>(q, k, v, mask, o, nullptr, nullptr, nullptr, nullptr, a);
}
extern "C" __global__ void __launch_bounds__(FA_THREADS) flash_fwd_128(FWD_PARAMS) {
    ARGS;
    flash_fwd<128, false>(q, k, v, mask, o, nullptr, nullptr, nullptr, nullptr, a);
}
extern "C" __global__ void __launch_bounds__(FA_THREADS) flash_stats_64(STATS_PARAMS) {
    ARGS;
    flash_fwd<64, true>(q, k, v, mask, o, lse, dout, delta, dq_acc, a);
}
extern "C" __global__ void __launch_bounds__(FA_THREADS) flash_stats_128(STATS_PARAMS) {
    ARGS;
    flash_fwd<128, true>(q, k, v, mask, o, lse, dout, delta, dq_acc, a);
}

#define BWD_PARAMS                                                                                           \
    const bf16_t *q, const bf16_t *k, const bf16_t *v, const bf16_t *dout, const float *lse, const float *delta, \
        float *dq_acc, float *dk_acc, float *dv_acc, const unsigned char *classes, const unsigned char *mask, long long heads, long long kv_heads, \
        long long t, long long s, long long q_b, long long q_h, long long q_t, long long k_b, long long k_h,     \
        long long k_t, long long v_b, long long v_h, long long v_t, long long m_b, long long m_h, long long m_q, \
        long long m_k, long long causal, double scale, long long class_heads

extern "C" __global__ void __launch_bounds__(FA_THREADS) flash_bwd_64(BWD_PARAMS) {
    ARGS;
    flash_bwd<64>(q, k, v, mask, dout, lse, delta, dq_acc, dk_acc, dv_acc, a, (float)scale);
}
extern "C" __global__ void __launch_bounds__(FA_THREADS) flash_bwd_128(BWD_PARAMS) {
    ARGS;
    flash_bwd<128>(q, k, v, mask, dout, lse, delta, dq_acc, dk_acc, dv_acc, a, (float)scale);
}

// dst [b, groups_out, n, D] (contiguous, element type) = sum over g < groups of
// src [b, groups_out * groups, n, D] (contiguous f32) at head h * groups + g.
extern "C" __global__ void flash_finish(const float* src, bf16_t* dst, long long total, long long n_d, long long groups) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= total) return;
    const long long inner = i % n_d, outer = i / n_d;  // outer = b * heads_out + head
    const float* p = src + outer * groups * n_d + inner;
    float acc = 0.0f;
    for (long long gi = 0; gi < groups; gi++) acc += p[gi * n_d];
    dst[i] = f32_to_bf16(acc);
}
