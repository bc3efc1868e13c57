// The next token of each row of logits, chosen on the device (sample.rs): one block per row
// reads the row three times (maximum, sum, masses of 128-token blocks) and writes the token
// and its log-probability, so that the host reads 8 bytes a row per decode step instead of
// the composition's two reads.
//
// The same choice as generate.rs (log_softmax_last, then greedy_on_device / draw_on_device):
//   x = logits / temperature (f32; logits as they are when greedy),
//   lp = x - (max + log(sum exp(x - max))),
//   greedy: the first index of the largest lp;
//   draw at u in [0, 1): masses of 128-token blocks (f32), the first block whose running sum
//   (f64) passes u x total, then the first token inside it whose running sum (f64) of exp(lp)
//   passes what is left; zero weights are never chosen, and when rounding leaves the target
//   past the total the last positive weight is.
//
// `u` holds each row's draw as the bits of a double (two ints, low word first); `out` is
// [rows, 2] ints: the token, then its log-probability's f32 bits.

#define DRAW_BLOCK 128
#define MAX_DRAW_BLOCKS 4096

template <typename T>
__device__ __forceinline__ float scaled(const T* p, long long i, float t) {
    return load(p, i) / t;
}

// The first of equal maxima wins, as a one-stage argmax breaks ties.
__device__ __forceinline__ void better(float& v, long long& i, float ov, long long oi) {
    if (ov > v || (ov == v && oi < i)) {
        v = ov;
        i = oi;
    }
}

template <typename T>
__device__ void sample_row(const T* logits, const int* u, int* out, long long vocab, long long row_stride, double temperature) {
    __shared__ float mass[MAX_DRAW_BLOCKS];
    __shared__ float best_v[32];
    __shared__ long long best_i[32];
    const long long row = blockIdx.x;
    const T* p = logits + row * row_stride;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, warps = blockDim.x >> 5;
    const bool greedy = !(temperature > 0.0);
    const float t = greedy ? 1.0f : (float)temperature;

    float m = NEG_INF;
    for (long long i = tid; i < vocab; i += blockDim.x) m = fmaxf(m, scaled(p, i, t));
    m = block_reduce(m, true);
    float s = 0.0f;
    for (long long i = tid; i < vocab; i += blockDim.x) s += expf(scaled(p, i, t) - m);
    s = block_reduce(s, false);
    const float lse = m + logf(s);

    if (greedy) {
        float v = NEG_INF;
        long long at = vocab;
        for (long long i = tid; i < vocab; i += blockDim.x) better(v, at, scaled(p, i, t) - lse, i);
        for (int o = 16; o > 0; o >>= 1) {
            float ov = __shfl_xor_sync(0xffffffffu, v, o);
            long long oi = __shfl_xor_sync(0xffffffffu, at, o);
            better(v, at, ov, oi);
        }
        if (lane == 0) {
            best_v[warp] = v;
            best_i[warp] = at;
        }
        __syncthreads();
        if (tid == 0) {
            for (int w = 1; w < warps; w++) better(v, at, best_v[w], best_i[w]);
            if (at >= vocab) at = 0;  // a row of NaN: the composition's argmax gives 0 too
            out[2 * row] = (int)at;
            out[2 * row + 1] = __float_as_int(v);
        }
        return;
    }

    const long long blocks = (vocab + DRAW_BLOCK - 1) / DRAW_BLOCK;
    for (long long b = warp; b < blocks; b += warps) {
        float acc = 0.0f;
        for (int k = lane; k < DRAW_BLOCK; k += 32) {
            const long long i = b * DRAW_BLOCK + k;
            if (i < vocab) acc += expf(scaled(p, i, t) - lse);
        }
        acc = warp_reduce(acc, false);
        if (lane == 0) mass[b] = acc;
    }
    __syncthreads();
    if (tid != 0) return;
    const double draw = __hiloint2double(u[2 * row + 1], u[2 * row]);
    double total = 0.0;
    for (long long b = 0; b < blocks; b++) total += (double)mass[b];
    // Stage one: the block.
    double target = draw * total, acc = 0.0;
    long long chosen = 0;
    double rest = 0.0;
    bool found = false;
    for (long long b = 0; b < blocks && !found; b++) {
        const double w = (double)mass[b];
        if (w > 0.0) {
            chosen = b;
            rest = target - acc;
            found = acc + w > target;
        }
        acc += w;
    }
    // Stage two: the token inside it.
    acc = 0.0;
    long long token = chosen * DRAW_BLOCK;
    found = false;
    for (int k = 0; k < DRAW_BLOCK && !found; k++) {
        const long long i = chosen * DRAW_BLOCK + k;
        if (i >= vocab) break;
        const float l = scaled(p, i, t) - lse;
        const double w = (double)expf(l);
        if (w > 0.0) {
            token = i;
            found = acc + w > rest;
        }
        acc += w;
    }
    out[2 * row] = (int)token;
    out[2 * row + 1] = __float_as_int(scaled(p, token, t) - lse);
}

extern "C" __global__ void sample_f32(const float* logits, const int* u, int* out, long long vocab, long long row_stride, double temperature) {
    sample_row<float>(logits, u, out, vocab, row_stride, temperature);
}
extern "C" __global__ void sample_bf16(const bf16_t* logits, const int* u, int* out, long long vocab, long long row_stride,
                                       double temperature) {
    sample_row<bf16_t>(logits, u, out, vocab, row_stride, temperature);
}
