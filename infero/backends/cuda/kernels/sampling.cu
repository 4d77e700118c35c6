// The GPU sampler: one token per row of float32 logits [*, V], by exactly the rules of infero/engine/sampling.py
// (its docstring is the contract; its step numbers are used below). Six launches, all rows at once:
//
//   sampler_modify    grid S        the row's sparse modifiers (steps 1-5 and 7 for the listed ids) -> z
//   sampler_prepare   grid G x S    z = mask ? double(logit) : -inf, / T (step 7) for every other id; per chunk:
//                                   max/argmax of z, and (logprob rows) raw max, sum exp, top-N raw logits
//   sampler_histogram grid G/k x S  (top-k/top-p rows) counts and fixed-point masses per 1/32-nat bucket below max z
//   sampler_select    grid S        min_p, top_k, top_p -> the support, as a value floor and a cut in sort order
//   sampler_gumbel    grid G x S    Philox4x64-10 noise, argmax of z - log(-log(u)) over the support, per chunk
//   sampler_finalize  grid S        the token (greedy: argmax of z), raw logprob and top-N logprobs; -2 for a row
//                                   with a NaN or infinite raw logit (prepare flags it per chunk)
//
// Chunks are CHUNK = 2048 consecutive ids of a row (G = ceil(V / CHUNK)); the per-chunk partials are reduced
// in chunk order by whoever needs them, so every result is a fixed function of the row (batch invariant,
// bitwise reproducible). Scratch: z [S, V] float64 (sampler_modify/prepare write it), a self-cleaning bitmap of
// modified ids [S, ceil(V/32)] and self-cleaning histograms [S, NB] (zeroed once at allocation; the kernel
// that reads them leaves them zero).
//
// Exactness. Steps 1-7 and min_p use only IEEE add, subtract, multiply, divide and compare on float64 in the
// reference's order, written with __dadd_rn & co. so nothing is contracted into an fma: z, max z, the min_p
// floor and the k-th largest value are bitwise the reference's, so min_p and top_k keep exactly its tokens
// (ties with the k-th value included). top_p and the noise go through exp and log, whose last bit may differ
// between CUDA's libm and numpy's (numpy's own differs between CPUs): see sampler_select and sampler_gumbel
// for where that can matter (only at a boundary that the exact real computation hits within ~1e-13).
//
// Speed on the H200 (2026-11-30, V = 151,936, GPU time of a replayed graph of the six kernels; rows of N(0, s^2)
// logits): greedy 11 us at 1 row, 0.53 us/row at 128 rows; temperature only 17 us / 2.0 us/row; min_p 14 us /
// 1.5 us/row; top_p 0.9 (T 0.7) 50-87 us / 2.5-3.7 us/row; top_k 20 + top_p 0.8 92-96 us / 2.9-3.1 us/row. At
// one row sampler_select (one block streaming the row) dominates the top_k/top_p cases; at 128 rows it is
// prepare (z written once, 1.2 MB/row), the histogram and the Philox noise (all ids within 41 nats of max z).

#define INF __longlong_as_double(0x7ff0000000000000ll)

namespace smp {

constexpr int CHUNK_THREADS = 256;
constexpr int ITEMS = 8;
constexpr int CHUNK = CHUNK_THREADS * ITEMS;  // ids per chunk: sampling.py CHUNK
constexpr int NB = 4096;                      // buckets below max z: sampling.py NUM_BUCKETS
constexpr double BUCKETS_PER_NAT = 32.0;      // bucket width 1/32 nat of z; the last bucket takes z < max - 128
constexpr int CAP = 4096;                     // candidates sorted in shared memory at once
constexpr int MAX_HIST_CHUNKS = 8;            // chunks per sampler_histogram block, at most
constexpr int SELECT_THREADS = 512;
constexpr int MAX_TOP = 20;                   // top logprobs per row: sampling.py MAX_TOP
constexpr int INT_MAX_ = 0x7fffffff;
constexpr int HIST_SMEM = NB * 20;            // sampler_histogram's dynamic shared memory: sampling.py HIST_SMEM
constexpr int SELECT_SMEM = 60 * 1024;       // sampler_select's: sampling.py SELECT_SMEM

// Row flags (sampling.py ROW_* constants).
constexpr int F_GREEDY = 1, F_TEMPERATURE = 2, F_MIN_P = 4, F_TOP_P = 8, F_REPETITION = 16, F_FREQ_PRES = 32;
// Modifier flags (sampling.py MOD_*).
constexpr int M_BIAS = 1, M_BANNED = 2, M_SEEN = 4;

// One row's parameters (sampling.py ROW_DTYPE, 104 bytes).
struct RowParams {
    double temperature;         // divides z when F_TEMPERATURE (not greedy, T != 1)
    double top_p;               // F_TOP_P when < 1
    double log_min_p;           // math.log(min_p), computed by Python, when F_MIN_P
    double repetition_penalty;  // F_REPETITION when != 1
    double frequency_penalty;   // F_FREQ_PRES when either is != 0 and the output is not empty
    double presence_penalty;
    unsigned long long key;      // Philox key word 0 (word 1 is 0)
    unsigned long long counter;  // Philox counter word 1: the output index (seeded) or engine draw number
    unsigned long long stream;   // Philox counter word 2: 0 seeded, 1 engine
    int top_k;                   // 0 = off, else 0 < top_k < V
    int flags;
    int logit_row;     // which row of the logits this row samples from
    int mask_row;      // row of the allowed-token bitmask, or -1
    int mod_begin, mod_end;  // this row's modifiers
    int num_logprobs;  // -1 = no logprobs, else the top-N count (0..20)
    int pad;
};

// One token whose z differs from the plain masked logit (sampling.py MOD_DTYPE, 24 bytes); ids unique per row.
struct Modifier {
    int id;
    int count;  // occurrences in the output (frequency/presence penalties)
    int flags;  // M_BIAS (bias below), M_BANNED, M_SEEN (in prompt or output: repetition penalty)
    int pad;
    double bias;
};

struct ChunkStats {  // sampler_prepare's partial for one chunk (32 bytes)
    double zmax;     // max of z over the chunk (-inf if none)
    double lmax;     // raw logit max (logprob rows)
    double lsum;     // sum of exp(logit - lmax) (logprob rows)
    int zarg;        // lowest id with z == zmax
    int nonfinite;   // 1 if a raw logit of the chunk is NaN or infinite (the model is broken)
};

struct TopEntry {  // one of a chunk's top-N raw logits
    float value;
    int id;  // -1: none
};

struct Support {     // sampler_select's result (24 bytes)
    double tau;      // keep z >= tau (min_p and top_k); -inf: no floor
    double x_last;   // with cut: keep (z, -id) >= (x_last, -id_last) lexicographically (top_p)
    int id_last;
    int cut;
};

struct Best {  // sampler_gumbel's partial (16 bytes)
    double score;
    int id;
    int pad;
};

struct U128 {
    unsigned long long lo, hi;
};

__device__ __forceinline__ U128 add128(U128 a, U128 b) {
    U128 r;
    r.lo = a.lo + b.lo;
    r.hi = a.hi + b.hi + (r.lo < a.lo ? 1ull : 0ull);
    return r;
}

// Monotone conversion (each step rounds to nearest; hi < 2^53 always).
__device__ __forceinline__ double to_double(U128 a) {
    return __dadd_rn(__dmul_rn(__ull2double_rn(a.hi), 0x1p64), __ull2double_rn(a.lo));
}

__device__ __forceinline__ void atomic_add128(unsigned long long* p, U128 v) {
    const unsigned long long old = atomicAdd(p, v.lo);
    const unsigned long long carry = (old + v.lo < old) ? 1ull : 0ull;
    if (v.hi + carry) atomicAdd(p + 1, v.hi + carry);
}

__device__ __forceinline__ bool allowed(const unsigned* mask_row, int t) {
    return mask_row == nullptr || ((mask_row[t >> 5] >> (t & 31)) & 1u);
}

// Bucket of z below zmax: floor((zmax - z) * 32), the last bucket for everything at or past 128 nats. Monotone:
// a larger z never gets a larger bucket, and equal z the same one.
__device__ __forceinline__ int bucket_of(double zmax, double z) {
    const double d = __dsub_rn(zmax, z);
    return d >= NB / BUCKETS_PER_NAT ? NB - 1 : (int)__dmul_rn(d, BUCKETS_PER_NAT);
}

// exp(z - zmax) in fixed point with 63 fractional bits (the max token weighs exactly 2^63), truncated: the
// top_p masses are sums of these, exact integers, so their sums do not depend on the order of addition.
// Truncation loses < 2^-63 per token: < V * 2^-63 (2e-14 at V = 152k) of mass, relative to the total >= 1.
__device__ __forceinline__ unsigned long long weight_of(double zmax, double z) {
    const double d = __dsub_rn(z, zmax);
    if (d < -44.0) return 0ull;  // exp(-44) * 2^63 < 1
    return __double2ull_rz(__dmul_rn(exp(d), 0x1p63));
}

// An order-preserving key of a double (larger z, larger key); -0.0 is keyed as +0.0 since they compare equal.
__device__ __forceinline__ unsigned long long key_of(double z) {
    const unsigned long long u = (unsigned long long)__double_as_longlong(z == 0.0 ? 0.0 : z);
    return (u >> 63) ? ~u : (u | 0x8000000000000000ull);
}

__device__ __forceinline__ double value_of(unsigned long long key) {
    const unsigned long long u = (key >> 63) ? (key & 0x7fffffffffffffffull) : ~key;
    return __longlong_as_double((long long)u);
}

__device__ __forceinline__ bool uses_histogram(const RowParams& p) {
    return !(p.flags & F_GREEDY) && (p.top_k > 0 || (p.flags & F_TOP_P));
}

// ---- block-wide helpers -------------------------------------------------------------------------------

// (value, id) argmax: larger value first, then lower id.
__device__ __forceinline__ bool better(double v, int id, double bv, int bid) {
    return v > bv || (v == bv && id < bid);
}

// The warp's best (v, id) in every lane, by a fixed xor butterfly.
__device__ __forceinline__ void warp_argmax(double& v, int& id) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const double ov = __shfl_xor_sync(0xffffffffu, v, o);
        const int oi = __shfl_xor_sync(0xffffffffu, id, o);
        if (better(ov, oi, v, id)) {
            v = ov;
            id = oi;
        }
    }
}

template <int THREADS>
__device__ __forceinline__ void block_argmax(double& v, int& id, double* sv, int* si) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    warp_argmax(v, id);
    if (lane == 0) {
        sv[warp] = v;
        si[warp] = id;
    }
    __syncthreads();
    if (warp == 0) {
        v = lane < THREADS / 32 ? sv[lane] : -INF;
        id = lane < THREADS / 32 ? si[lane] : INT_MAX_;
        warp_argmax(v, id);
        if (lane == 0) {
            sv[32] = v;
            si[32] = id;
        }
    }
    __syncthreads();
    v = sv[32];
    id = si[32];
    __syncthreads();
}

// Max of z over the row from the chunk partials, and the lowest id holding it (all threads get both).
template <int THREADS>
__device__ __forceinline__ double row_max(const ChunkStats* stats, int G, int* arg, double* sv, int* si) {
    double m = -INF;
    int a = INT_MAX_;
    for (int c = threadIdx.x; c < G; c += THREADS) {
        if (better(stats[c].zmax, stats[c].zarg, m, a)) {
            m = stats[c].zmax;
            a = stats[c].zarg;
        }
    }
    block_argmax<THREADS>(m, a, sv, si);
    *arg = a;
    return m;
}

template <int THREADS>
__device__ __forceinline__ double block_sum_double(double v, double* sv) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = __dadd_rn(v, __shfl_xor_sync(0xffffffffu, v, o));
    if (lane == 0) sv[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < THREADS / 32 ? sv[lane] : 0.0;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) v = __dadd_rn(v, __shfl_xor_sync(0xffffffffu, v, o));
        if (lane == 0) sv[32] = v;
    }
    __syncthreads();
    v = sv[32];
    __syncthreads();
    return v;
}

__device__ __forceinline__ U128 shfl_up128(U128 v, int o) {
    U128 r;
    r.lo = __shfl_up_sync(0xffffffffu, v.lo, o);
    r.hi = __shfl_up_sync(0xffffffffu, v.hi, o);
    return r;
}

// Exclusive prefix sum over the block's threads (exact integers); *total gets the sum of all.
template <int THREADS>
__device__ __forceinline__ U128 block_exclusive_scan128(U128 v, U128* s, U128* total) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    U128 inc = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const U128 other = shfl_up128(inc, o);
        if (lane >= o) inc = add128(inc, other);
    }
    if (lane == 31) s[warp] = inc;
    __syncthreads();
    if (warp == 0) {
        U128 w = lane < THREADS / 32 ? s[lane] : U128{0ull, 0ull};
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const U128 other = shfl_up128(w, o);
            if (lane >= o) w = add128(w, other);
        }
        s[32 + lane] = w;  // inclusive scan of the warp totals
    }
    __syncthreads();
    const U128 before = warp == 0 ? U128{0ull, 0ull} : s[32 + warp - 1];
    *total = s[32 + THREADS / 32 - 1];
    __syncthreads();
    U128 excl = add128(before, inc);
    // excl currently holds the inclusive prefix; subtract v (exact: no underflow).
    const unsigned long long lo = excl.lo - v.lo;
    excl.hi = excl.hi - v.hi - (excl.lo < v.lo ? 1ull : 0ull);
    excl.lo = lo;
    return excl;
}

template <int THREADS>
__device__ __forceinline__ unsigned block_exclusive_scan_u32(unsigned v, unsigned* s, unsigned* total) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    unsigned inc = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const unsigned other = __shfl_up_sync(0xffffffffu, inc, o);
        if (lane >= o) inc += other;
    }
    if (lane == 31) s[warp] = inc;
    __syncthreads();
    if (warp == 0) {
        unsigned w = lane < THREADS / 32 ? s[lane] : 0u;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const unsigned other = __shfl_up_sync(0xffffffffu, w, o);
            if (lane >= o) w += other;
        }
        s[32 + lane] = w;
    }
    __syncthreads();
    const unsigned before = warp == 0 ? 0u : s[32 + warp - 1];
    *total = s[32 + THREADS / 32 - 1];
    __syncthreads();
    return before + inc - v;
}

// ---- Philox4x64-10 (Random123; numpy.random.Philox) --------------------------------------------------------

constexpr unsigned long long PHILOX_M0 = 0xD2E7470EE14C6C93ull;
constexpr unsigned long long PHILOX_M1 = 0xCA5A826395121157ull;
constexpr unsigned long long PHILOX_W0 = 0x9E3779B97F4A7C15ull;
constexpr unsigned long long PHILOX_W1 = 0xBB67AE8584CAA73Bull;

// The block at counter (c0, c1, c2, 0) under key (k0, 0). numpy's Philox adds one to its counter before each
// block; sampling.py starts it one below (0, i, s, 0), so its block j is exactly this with c0 = j.
__device__ __forceinline__ void philox4x64_10(unsigned long long c0, unsigned long long c1, unsigned long long c2,
                                              unsigned long long k0, unsigned long long out[4]) {
    unsigned long long x0 = c0, x1 = c1, x2 = c2, x3 = 0ull, k1 = 0ull;
#pragma unroll
    for (int r = 0; r < 10; ++r) {
        if (r > 0) {
            k0 += PHILOX_W0;
            k1 += PHILOX_W1;
        }
        const unsigned long long lo0 = PHILOX_M0 * x0, hi0 = __umul64hi(PHILOX_M0, x0);
        const unsigned long long lo1 = PHILOX_M1 * x2, hi1 = __umul64hi(PHILOX_M1, x2);
        const unsigned long long y0 = hi1 ^ x1 ^ k0, y2 = hi0 ^ x3 ^ k1;
        x0 = y0;
        x1 = lo1;
        x2 = y2;
        x3 = lo0;
    }
    out[0] = x0;
    out[1] = x1;
    out[2] = x2;
    out[3] = x3;
}

__device__ __forceinline__ bool in_support(double z, int t, const Support& s) {
    if (!(z > -INF) || z < s.tau) return false;
    return !s.cut || z > s.x_last || (z == s.x_last && t <= s.id_last);
}

}  // namespace smp

using namespace smp;

// Steps 1-5 (and 7) for the ids a row's modifiers list: mask, bias, ban, repetition penalty, frequency and
// presence penalties, each as the reference does it, then the temperature. Marks them in the bitmap so that
// sampler_prepare leaves them alone.
extern "C" __global__ void __launch_bounds__(256) sampler_modify(
    const RowParams* __restrict__ rows, const Modifier* __restrict__ mods, const float* __restrict__ logits,
    const unsigned* __restrict__ masks, double* __restrict__ zbuf, unsigned* __restrict__ modbits, int V, int W) {
    const int row = blockIdx.x;
    const RowParams p = rows[row];
    const float* lrow = logits + (size_t)p.logit_row * V;
    const unsigned* mrow = p.mask_row >= 0 ? masks + (size_t)p.mask_row * W : nullptr;
    double* zrow = zbuf + (size_t)row * V;
    for (int e = p.mod_begin + threadIdx.x; e < p.mod_end; e += 256) {
        const Modifier m = mods[e];
        const int t = m.id;
        double z = allowed(mrow, t) ? (double)lrow[t] : -INF;  // step 1
        if (m.flags & M_BIAS) z = __dadd_rn(z, m.bias);            // step 2
        if (m.flags & M_BANNED) z = -INF;                          // step 3
        if ((p.flags & F_REPETITION) && (m.flags & M_SEEN)) {      // step 4
            z = z > 0.0 ? __ddiv_rn(z, p.repetition_penalty) : __dmul_rn(z, p.repetition_penalty);
        }
        if ((p.flags & F_FREQ_PRES) && m.count > 0) {  // step 5 (a zero count subtracts zero)
            z = __dsub_rn(z, __dmul_rn(p.frequency_penalty, (double)m.count));
            z = __dsub_rn(z, p.presence_penalty);
        }
        if (p.flags & F_TEMPERATURE) z = __ddiv_rn(z, p.temperature);  // step 7
        zrow[t] = z;
        atomicOr(&modbits[(size_t)row * W + (t >> 5)], 1u << (t & 31));
    }
}

// z for every id sampler_modify did not list (and clears the bitmap), the chunk's max/argmax of z, and for
// logprob rows the raw logits' max, sum of exp and top-N (by logit descending, id ascending).
extern "C" __global__ void __launch_bounds__(CHUNK_THREADS) sampler_prepare(
    const RowParams* __restrict__ rows, const float* __restrict__ logits, const unsigned* __restrict__ masks,
    double* __restrict__ zbuf, unsigned* __restrict__ modbits, ChunkStats* __restrict__ stats,
    TopEntry* __restrict__ tops, int V, int W, int G) {
    __shared__ double sv[33];
    __shared__ int si[33];
    const int chunk = blockIdx.x, row = blockIdx.y, lane = threadIdx.x % 32;
    const RowParams p = rows[row];
    const float* lrow = logits + (size_t)p.logit_row * V;
    const unsigned* mrow = p.mask_row >= 0 ? masks + (size_t)p.mask_row * W : nullptr;
    double* zrow = zbuf + (size_t)row * V;
    unsigned* bits = modbits + (size_t)row * W;
    const bool greedy = p.flags & F_GREEDY;
    const int c0 = chunk * CHUNK;
    // All loads first (a warp's 32 ids share one word of each bitmap), then the arithmetic.
    float lv[ITEMS];
    unsigned words[ITEMS], allowed_words[ITEMS];
#pragma unroll
    for (int j = 0; j < ITEMS; ++j) {
        const int t = c0 + j * CHUNK_THREADS + threadIdx.x;
        const bool in = t < V;
        lv[j] = in ? lrow[t] : -__int_as_float(0x7f800000);
        words[j] = in ? bits[t >> 5] : 0u;
        allowed_words[j] = (in && mrow) ? mrow[t >> 5] : ~0u;
    }
    double best = -INF;
    int best_id = INT_MAX_;
#pragma unroll
    for (int j = 0; j < ITEMS; ++j) {
        const int t = c0 + j * CHUNK_THREADS + threadIdx.x;
        if (t >= V) continue;
        double z;
        if ((words[j] >> (t & 31)) & 1u) {
            z = zrow[t];
        } else {
            z = ((allowed_words[j] >> (t & 31)) & 1u) ? (double)lv[j] : -INF;
            if (p.flags & F_TEMPERATURE) z = __ddiv_rn(z, p.temperature);
            if (!greedy) zrow[t] = z;
        }
        if (z > best) {  // ids increase along j: the first max is kept
            best = z;
            best_id = t;
        }
    }
    bool bad = false;  // a non-finite raw logit: the row's token becomes -2 (sampling.py NON_FINITE_LOGITS)
#pragma unroll
    for (int j = 0; j < ITEMS; ++j) bad |= c0 + j * CHUNK_THREADS + (int)threadIdx.x < V && !isfinite(lv[j]);
    const int nonfinite = __syncthreads_or(bad);
    __syncwarp();  // every lane has read the words before lane 0 clears them
    if (lane == 0) {
#pragma unroll
        for (int j = 0; j < ITEMS; ++j) {
            if (words[j]) bits[(c0 + j * CHUNK_THREADS + (int)threadIdx.x) >> 5] = 0u;
        }
    }
    block_argmax<CHUNK_THREADS>(best, best_id, sv, si);
    ChunkStats out;
    out.zmax = best;
    out.zarg = best_id;
    out.lmax = 0.0;
    out.lsum = 0.0;
    out.nonfinite = nonfinite;
    if (p.num_logprobs >= 0) {
        double m = -INF;
        int unused = 0;
#pragma unroll
        for (int j = 0; j < ITEMS; ++j) m = fmax(m, (double)lv[j]);
        block_argmax<CHUNK_THREADS>(m, unused, sv, si);
        double s = 0.0;
#pragma unroll
        for (int j = 0; j < ITEMS; ++j) {
            if (c0 + j * CHUNK_THREADS + (int)threadIdx.x < V) s = __dadd_rn(s, exp(__dsub_rn((double)lv[j], m)));
        }
        out.lmax = m;
        out.lsum = block_sum_double<CHUNK_THREADS>(s, sv);
        // Top-N of the chunk: N rounds of a block argmax below the previous pick.
        double prev_v = INF;
        int prev_id = -1;
        TopEntry* mine = tops + ((size_t)row * G + chunk) * MAX_TOP;
        for (int k = 0; k < p.num_logprobs; ++k) {
            double v = -INF;
            int id = INT_MAX_;
#pragma unroll
            for (int j = 0; j < ITEMS; ++j) {
                const int t = c0 + j * CHUNK_THREADS + threadIdx.x;
                const double x = (double)lv[j];
                const bool below = x < prev_v || (x == prev_v && t > prev_id);
                if (t < V && below && better(x, t, v, id)) {
                    v = x;
                    id = t;
                }
            }
            block_argmax<CHUNK_THREADS>(v, id, sv, si);
            if (threadIdx.x == 0) {
                TopEntry e;
                e.value = (float)v;
                e.id = id == INT_MAX_ ? -1 : id;
                mine[k] = e;
            }
            prev_v = v;
            prev_id = id;
        }
    }
    if (threadIdx.x == 0) stats[(size_t)row * G + chunk] = out;
}

// Per row that uses top_k or top_p: for each z >= the min_p floor, count it in bucket floor((zmax - z) * 32)
// and add its fixed-point weight exp(z - zmax) * 2^63 (top_p rows). A block covers `per_block` (<= 8) chunks
// and keeps the weights in shared memory as four 16-bit limbs in 32-bit counters (32-bit shared atomics are
// native; 64-bit ones are compare-and-swap loops), then adds its histogram into the row's with integer
// atomics: integer sums, the same in any order and for any per_block. A top_p row without top_k skips
// z < zmax - 44 (weight 0: those buckets can never hold the cut, whose mass before it is < top_p * W < W),
// and whole chunks whose max is below what is counted.
extern "C" __global__ void __launch_bounds__(CHUNK_THREADS) sampler_histogram(
    const RowParams* __restrict__ rows, const double* __restrict__ zbuf, const ChunkStats* __restrict__ stats,
    unsigned* __restrict__ hist_count, unsigned long long* __restrict__ hist_mass, int V, int G, int per_block) {
    extern __shared__ unsigned hist_smem[];  // limbs [4][NB] then count [NB]
    static_assert(HIST_SMEM == 5 * NB * sizeof(unsigned), "HIST_SMEM");
    static_assert((long long)MAX_HIST_CHUNKS * CHUNK * 0xffff < (1ll << 32), "a limb sum could overflow");
    unsigned* limbs = hist_smem;
    unsigned* count = hist_smem + 4 * NB;
    __shared__ double sv[33];
    __shared__ int si[33];
    const int row = blockIdx.y;
    const RowParams p = rows[row];
    if (!uses_histogram(p)) return;
    const ChunkStats* row_stats = stats + (size_t)row * G;
    for (int b = threadIdx.x; b < 5 * NB; b += CHUNK_THREADS) hist_smem[b] = 0u;
    int arg;
    const double zmax = row_max<CHUNK_THREADS>(row_stats, G, &arg, sv, si);  // its barriers cover the zeroing
    if (!(zmax > -INF)) return;
    const double tau = (p.flags & F_MIN_P) ? __dadd_rn(zmax, p.log_min_p) : -INF;
    const bool top_p = p.flags & F_TOP_P, mass_only = p.top_k == 0;
    const double* zrow = zbuf + (size_t)row * V;
    per_block = min(per_block, MAX_HIST_CHUNKS);  // the launcher's grid covers G with this many
    bool any = false;
    for (int chunk = blockIdx.x * per_block; chunk < min(G, (blockIdx.x + 1) * per_block); ++chunk) {
        const double cm = row_stats[chunk].zmax;
        if (!(cm >= tau) || (mass_only && __dsub_rn(cm, zmax) < -44.0)) continue;
        any = true;
        double zs[ITEMS];
#pragma unroll
        for (int j = 0; j < ITEMS; ++j) {
            const int t = chunk * CHUNK + j * CHUNK_THREADS + threadIdx.x;
            zs[j] = t < V ? zrow[t] : -INF;
        }
#pragma unroll
        for (int j = 0; j < ITEMS; ++j) {
            const double z = zs[j];
            if (!(z > -INF) || z < tau || (mass_only && __dsub_rn(z, zmax) < -44.0)) continue;
            const int b = bucket_of(zmax, z);
            atomicAdd(&count[b], 1u);
            if (top_p) {
                const unsigned long long w = weight_of(zmax, z);
#pragma unroll
                for (int l = 0; l < 4; ++l) {
                    const unsigned limb = (unsigned)(w >> (16 * l)) & 0xffffu;  // sums <= 2^14 * 2^16: no overflow
                    if (limb) atomicAdd(&limbs[l * NB + b], limb);
                }
            }
        }
    }
    if (!any) return;
    __syncthreads();
    unsigned* gcount = hist_count + (size_t)row * NB;
    unsigned long long* gmass = hist_mass + (size_t)row * NB * 2;
    for (int b = threadIdx.x; b < NB; b += CHUNK_THREADS) {
        if (count[b]) atomicAdd(&gcount[b], count[b]);
        const unsigned long long l0 = limbs[b], l1 = limbs[NB + b], l2 = limbs[2 * NB + b], l3 = limbs[3 * NB + b];
        if (l0 | l1 | l2 | l3) {
            U128 v = add128(U128{l0, 0ull}, U128{l1 << 16, 0ull});
            v = add128(v, U128{l2 << 32, 0ull});
            v = add128(v, U128{l3 << 48, l3 >> 16});
            atomic_add128(&gmass[2 * b], v);
        }
    }
}

// ---- sampler_select: min_p, top_k, top_p ----------------------------------------------------------------
//
// The support the reference keeps is a prefix of the survivors sorted by (z descending, id ascending):
//   min_p:  z >= zmax + log(min_p)                       (exact: the same float64 add and compare)
//   top_k:  z >= the k-th largest surviving z            (exact: that value is found, not approximated)
//   top_p:  every token whose mass_before < top_p, mass_before = the normalised weight of the tokens
//           before it. Weights only grow mass_before along the order, so the kept set is the prefix ending at
//           the last token L with mass_before(L) < top_p; we find L and keep (z, -id) >= (z_L, -id_L).
// Buckets of z below zmax are a monotone function of z, so they cut the sorted order into consecutive runs
// (equal z share a bucket). The k-th value lies in the bucket where the running count reaches k; L lies in
// the last non-empty bucket whose running mass before it is < top_p * W. That bucket's candidates are gathered
// (<= CAP of them: else a radix descent on the 64-bit key of z, then on the id, narrows them first; each level
// is again a run of the order), sorted by (z desc, id asc) in shared memory, and resolved exactly.
//
// Masses are exact 128-bit integer sums of the 63-bit fixed-point weights (weight_of), compared as
// double(mass_before) < top_p * double(W). The reference compares a float64 cumsum of float64 quotients; both
// are within ~1e-13 of the exact real value for realistic rows (ours: < V * 2^-63 truncation plus 3 roundings;
// the reference: ~n * 2^-53 for the n tokens before the cut), and the exp inside differs by at most an ulp or
// two, so the supports differ only when top_p lies that close to some token's mass_before: never seen in the
// tests, and impossible when the masses are exactly representable (ties of equal z, powers of two).

namespace smp {

constexpr int MAX_SHARED_CHUNKS = 256;  // chunk maxima kept in shared memory (V <= 524,288; beyond: global)

struct SelectShared {
    double chunk_max[MAX_SHARED_CHUNKS];
    unsigned long long keys[CAP];
    unsigned ids[CAP];
    unsigned digit_count[256];
    unsigned long long digit_mass[512];
    U128 scan[64];
    unsigned uscan[64];
    double sv[33];
    int si[33];
    unsigned n;
    unsigned long long kmin, kmax;
    unsigned idmin, idmax;
    int pick;
    U128 pick_mass;
    unsigned pick_rank;
};

static_assert(sizeof(SelectShared) <= SELECT_SMEM, "SelectShared outgrew SELECT_SMEM");

// Candidates of one resolution: finite z >= tau in bucket b, optionally with key prefix and id prefix.
struct Candidates {
    double zmax, tau;
    int b;
    int zshift;  // 64: no key constraint; else key >> zshift == zprefix
    unsigned long long zprefix;
    int idshift;  // 32: no id constraint; else id >> idshift == idprefix
    unsigned idprefix;

    __device__ __forceinline__ bool has(double z, int t) const {
        if (!(z > -INF) || z < tau || bucket_of(zmax, z) != b) return false;
        if (zshift < 64 && (key_of(z) >> zshift) != zprefix) return false;
        return idshift >= 32 || ((unsigned)t >> idshift) == idprefix;
    }
};

// A chunk none of whose ids can be a candidate: its max z is below tau or in a later bucket.
__device__ __forceinline__ bool skip_chunk(const ChunkStats* stats, const SelectShared& sh, int chunk,
                                           const Candidates& c) {
    const double m = chunk < MAX_SHARED_CHUNKS ? sh.chunk_max[chunk] : stats[chunk].zmax;
    return !(m >= c.tau) || bucket_of(c.zmax, m) > c.b;
}

constexpr int GROUP_CHUNKS = 4;                                    // chunks whose loads are in flight together
constexpr int PER_CHUNK = CHUNK / SELECT_THREADS;                   // ids per thread per chunk
constexpr int GROUP_ITEMS = GROUP_CHUNKS * PER_CHUNK;

// f(z, id) for every candidate, visiting chunks in groups whose loads are all issued before any is used
// (one block streams the row: it needs many loads in flight to approach the memory bandwidth).
template <typename F>
__device__ __forceinline__ void for_candidates(const double* zrow, const ChunkStats* stats, int V, int G,
                                               const Candidates& c, const SelectShared& sh, F f) {
    for (int c0 = 0; c0 < G; c0 += GROUP_CHUNKS) {
        bool live[GROUP_CHUNKS];
        bool any = false;
#pragma unroll
        for (int k = 0; k < GROUP_CHUNKS; ++k) {
            live[k] = c0 + k < G && !skip_chunk(stats, sh, c0 + k, c);
            any |= live[k];
        }
        if (!any) continue;
        double z[GROUP_ITEMS];
#pragma unroll
        for (int i = 0; i < GROUP_ITEMS; ++i) {
            const int t = (c0 + i / PER_CHUNK) * CHUNK + (i % PER_CHUNK) * SELECT_THREADS + threadIdx.x;
            z[i] = (live[i / PER_CHUNK] && t < V) ? zrow[t] : -INF;
        }
#pragma unroll
        for (int i = 0; i < GROUP_ITEMS; ++i) {
            const int t = (c0 + i / PER_CHUNK) * CHUNK + (i % PER_CHUNK) * SELECT_THREADS + threadIdx.x;
            if (c.has(z[i], t)) f(z[i], t);
        }
    }
}

// Gather the candidates (up to CAP) into shared memory; returns their number, min/max key and id.
__device__ unsigned gather(const double* zrow, const ChunkStats* stats, int V, int G, const Candidates& c,
                           SelectShared& sh) {
    if (threadIdx.x == 0) {
        sh.n = 0u;
        sh.kmin = ~0ull;
        sh.kmax = 0ull;
        sh.idmin = ~0u;
        sh.idmax = 0u;
    }
    __syncthreads();
    unsigned long long kmin = ~0ull, kmax = 0ull;
    unsigned idmin = ~0u, idmax = 0u;
    for_candidates(zrow, stats, V, G, c, sh, [&](double z, int t) {
        const unsigned slot = atomicAdd(&sh.n, 1u);
        const unsigned long long k = key_of(z);
        if (slot < CAP) {
            sh.keys[slot] = k;
            sh.ids[slot] = (unsigned)t;
        }
        kmin = min(kmin, k);
        kmax = max(kmax, k);
        idmin = min(idmin, (unsigned)t);
        idmax = max(idmax, (unsigned)t);
    });
    atomicMin(&sh.kmin, kmin);
    atomicMax(&sh.kmax, kmax);
    atomicMin(&sh.idmin, idmin);
    atomicMax(&sh.idmax, idmax);
    __syncthreads();
    return sh.n;
}

// entry a goes before entry b: z descending, then id ascending.
__device__ __forceinline__ bool before(unsigned long long ka, unsigned ia, unsigned long long kb, unsigned ib) {
    return ka > kb || (ka == kb && ia < ib);
}

__device__ void sort_gathered(unsigned n, SelectShared& sh) {
    unsigned size = 2;
    while (size < n) size <<= 1;
    for (unsigned i = n + threadIdx.x; i < size; i += SELECT_THREADS) {
        sh.keys[i] = 0ull;  // after every finite z
        sh.ids[i] = ~0u;
    }
    __syncthreads();
    for (unsigned k = 2; k <= size; k <<= 1) {
        for (unsigned j = k >> 1; j > 0; j >>= 1) {
            for (unsigned i = threadIdx.x; i < size; i += SELECT_THREADS) {
                const unsigned partner = i ^ j;
                if (partner <= i) continue;
                const unsigned long long ki = sh.keys[i], kp = sh.keys[partner];
                const unsigned ii = sh.ids[i], ip = sh.ids[partner];
                const bool ascending = (i & k) == 0;
                if (ascending ? before(kp, ip, ki, ii) : before(ki, ii, kp, ip)) {
                    sh.keys[i] = kp;
                    sh.keys[partner] = ki;
                    sh.ids[i] = ip;
                    sh.ids[partner] = ii;
                }
            }
            __syncthreads();
        }
    }
}

// Mass mode, on the sorted candidates: the last index whose mass_before (base + weights before it) is < P.
__device__ int last_below(unsigned n, double zmax, U128 base, double P, SelectShared& sh) {
    constexpr int PER = CAP / SELECT_THREADS;
    U128 local = {0ull, 0ull};
    unsigned long long w[PER];
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        const unsigned idx = threadIdx.x * PER + i;
        w[i] = idx < n ? weight_of(zmax, value_of(sh.keys[idx])) : 0ull;
        local = add128(local, U128{w[i], 0ull});
    }
    U128 total;
    U128 run = add128(base, block_exclusive_scan128<SELECT_THREADS>(local, sh.scan, &total));
    unsigned below = 0;
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        const unsigned idx = threadIdx.x * PER + i;
        if (idx < n && to_double(run) < P) ++below;
        run = add128(run, U128{w[i], 0ull});
    }
    unsigned count;
    block_exclusive_scan_u32<SELECT_THREADS>(below, sh.uscan, &count);
    return (int)count - 1;
}

// One level of the radix descent: counts (and masses) of the candidates by their next digit.
__device__ void digit_histogram(const double* zrow, const ChunkStats* stats, int V, int G, const Candidates& c,
                                int dbits, bool on_id, bool with_mass, SelectShared& sh) {
    for (int d = threadIdx.x; d < 256; d += SELECT_THREADS) {
        sh.digit_count[d] = 0u;
        sh.digit_mass[2 * d] = 0ull;
        sh.digit_mass[2 * d + 1] = 0ull;
    }
    __syncthreads();
    const int shift = on_id ? c.idshift - dbits : c.zshift - dbits;
    const unsigned mask = (1u << dbits) - 1u;
    for_candidates(zrow, stats, V, G, c, sh, [&](double z, int t) {
        const unsigned d = on_id ? ((unsigned)t >> shift) & mask : (unsigned)(key_of(z) >> shift) & mask;
        atomicAdd(&sh.digit_count[d], 1u);
        if (with_mass) {
            const unsigned long long w = weight_of(c.zmax, z);
            if (w) atomic_add128(&sh.digit_mass[2 * d], U128{w, 0ull});
        }
    });
    __syncthreads();
}

// Resolve inside bucket c.b. Rank mode (P < 0): the z at 0-based `rank` of the sorted candidates. Mass mode:
// the last candidate whose mass_before (base + the candidates before it) is < P; *id_out gets its id.
__device__ double resolve(const double* zrow, const ChunkStats* stats, int V, int G, Candidates c, unsigned rank,
                          U128 base, double P, int* id_out, SelectShared& sh) {
    const bool mass_mode = P >= 0.0;
    for (;;) {
        const unsigned n = gather(zrow, stats, V, G, c, sh);
        if (n <= CAP) {
            sort_gathered(n, sh);
            const int idx = mass_mode ? last_below(n, c.zmax, base, P, sh) : (int)rank;
            const double z = value_of(sh.keys[idx]);
            *id_out = (int)sh.ids[idx];
            __syncthreads();
            return z;
        }
        // Too many: narrow by the bits all candidates share, then by the next digit of the key (or the id
        // once every candidate has the same z).
        bool on_id;
        if (sh.kmin != sh.kmax) {
            c.zshift = 64 - __clzll((long long)(sh.kmin ^ sh.kmax));
            if (c.zshift < 64) c.zprefix = sh.kmin >> c.zshift;
            on_id = false;
        } else {
            c.zshift = 0;
            c.zprefix = sh.kmin;
            c.idshift = 32 - __clz((int)(sh.idmin ^ sh.idmax));
            if (c.idshift < 32) c.idprefix = sh.idmin >> c.idshift;
            on_id = true;
        }
        const int dbits = min(8, on_id ? c.idshift : c.zshift);
        digit_histogram(zrow, stats, V, G, c, dbits, on_id, mass_mode, sh);
        if (threadIdx.x == 0) {
            // Digit order along the sort: key digits descending (larger z first), id digits ascending.
            const int ndig = 1 << dbits;
            unsigned seen = 0;
            U128 acc = base;
            int pick = -1;
            unsigned pick_rank = 0;
            U128 pick_mass = base;
            for (int i = 0; i < ndig; ++i) {
                const int d = on_id ? i : ndig - 1 - i;
                const unsigned cnt = sh.digit_count[d];
                if (cnt == 0) continue;
                if (mass_mode) {
                    if (to_double(acc) < P) {
                        pick = d;
                        pick_mass = acc;
                    }
                    acc = add128(acc, U128{sh.digit_mass[2 * d], sh.digit_mass[2 * d + 1]});
                } else if (pick < 0) {
                    if (rank < seen + cnt) {
                        pick = d;
                        pick_rank = rank - seen;
                    }
                    seen += cnt;
                }
            }
            sh.pick = pick;
            sh.pick_mass = pick_mass;
            sh.pick_rank = pick_rank;
        }
        __syncthreads();
        const unsigned d = (unsigned)sh.pick;
        if (mass_mode) {
            base = sh.pick_mass;
        } else {
            rank = sh.pick_rank;
        }
        __syncthreads();
        if (on_id) {
            c.idprefix = c.idshift >= 32 ? d : (c.idprefix << dbits) | d;
            c.idshift -= dbits;
        } else {
            c.zprefix = c.zshift >= 64 ? (unsigned long long)d : (c.zprefix << dbits) | d;
            c.zshift -= dbits;
        }
    }
}

// Sum of the weights of the candidates (exact).
__device__ U128 candidate_mass(const double* zrow, const ChunkStats* stats, int V, int G, const Candidates& c,
                               SelectShared& sh) {
    U128 local = {0ull, 0ull};
    for_candidates(zrow, stats, V, G, c, sh,
                   [&](double z, int) { local = add128(local, U128{weight_of(c.zmax, z), 0ull}); });
    U128 total;
    block_exclusive_scan128<SELECT_THREADS>(local, sh.scan, &total);
    return total;
}

}  // namespace smp

extern "C" __global__ void __launch_bounds__(SELECT_THREADS) sampler_select(
    const RowParams* __restrict__ rows, const double* __restrict__ zbuf, const ChunkStats* __restrict__ stats_all,
    unsigned* __restrict__ hist_count, unsigned long long* __restrict__ hist_mass, Support* __restrict__ support,
    int V, int G) {
    extern __shared__ unsigned long long select_smem[];
    SelectShared& sh = *reinterpret_cast<SelectShared*>(select_smem);
    __shared__ int bk_s, bp_s;
    __shared__ unsigned rank_s;
    __shared__ U128 base_s;
    const int row = blockIdx.x;
    const RowParams p = rows[row];
    const ChunkStats* stats = stats_all + (size_t)row * G;
    const double* zrow = zbuf + (size_t)row * V;
    int arg;
    const double zmax = row_max<SELECT_THREADS>(stats, G, &arg, sh.sv, sh.si);
    for (int c = threadIdx.x; c < min(G, MAX_SHARED_CHUNKS); c += SELECT_THREADS) sh.chunk_max[c] = stats[c].zmax;
    __syncthreads();
    Support sup;
    sup.tau = -INF;
    sup.x_last = 0.0;
    sup.id_last = 0;
    sup.cut = 0;
    if ((p.flags & F_GREEDY) || !(zmax > -INF)) {
        if (threadIdx.x == 0) support[row] = sup;
        return;
    }
    if (p.flags & F_MIN_P) sup.tau = __dadd_rn(zmax, p.log_min_p);  // step 8
    if (!uses_histogram(p)) {
        if (threadIdx.x == 0) support[row] = sup;
        return;
    }
    // The row's histogram, 8 consecutive buckets per thread; left zeroed for the next step.
    constexpr int PER = NB / SELECT_THREADS;
    unsigned cnt[PER];
    U128 mass[PER];
    unsigned* gcount = hist_count + (size_t)row * NB;
    unsigned long long* gmass = hist_mass + (size_t)row * NB * 2;
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        const int b = threadIdx.x * PER + i;
        cnt[i] = gcount[b];
        mass[i] = U128{gmass[2 * b], gmass[2 * b + 1]};
        gcount[b] = 0u;
        gmass[2 * b] = 0ull;
        gmass[2 * b + 1] = 0ull;
    }
    Candidates c;
    c.zmax = zmax;
    c.tau = sup.tau;
    c.zshift = 64;
    c.zprefix = 0ull;
    c.idshift = 32;
    c.idprefix = 0u;
    int bk = NB;  // after top_k, buckets past bk hold no survivor
    if (p.top_k > 0) {  // step 9
        unsigned local = 0;
#pragma unroll
        for (int i = 0; i < PER; ++i) local += cnt[i];
        unsigned total;
        unsigned run = block_exclusive_scan_u32<SELECT_THREADS>(local, sh.uscan, &total);
        const unsigned k = (unsigned)p.top_k;
        if (total >= k) {  // else the k-th largest is -inf: nothing dropped
#pragma unroll
            for (int i = 0; i < PER; ++i) {
                if (run < k && k <= run + cnt[i]) {
                    bk_s = threadIdx.x * PER + i;
                    rank_s = k - 1 - run;
                }
                run += cnt[i];
            }
            __syncthreads();
            bk = bk_s;
            c.b = bk;
            int unused;
            const double kth = resolve(zrow, stats, V, G, c, rank_s, U128{0ull, 0ull}, -1.0, &unused, sh);
            sup.tau = kth;  // >= the min_p floor: it is one of the candidates
            c.tau = kth;
            if (p.flags & F_TOP_P) {
                const U128 mk = candidate_mass(zrow, stats, V, G, c, sh);
#pragma unroll
                for (int i = 0; i < PER; ++i) {
                    const int b = threadIdx.x * PER + i;
                    if (b == bk) mass[i] = mk;
                    if (b > bk) {
                        mass[i] = U128{0ull, 0ull};
                        cnt[i] = 0u;
                    }
                }
            }
        }
    }
    if (p.flags & F_TOP_P) {  // step 10
        U128 local = {0ull, 0ull};
#pragma unroll
        for (int i = 0; i < PER; ++i) local = add128(local, mass[i]);
        U128 total;
        U128 run = block_exclusive_scan128<SELECT_THREADS>(local, sh.scan, &total);
        const double P = __dmul_rn(p.top_p, to_double(total));
        if (threadIdx.x == 0) bp_s = -1;
        __syncthreads();
        int last = -1;
        U128 last_base = {0ull, 0ull};
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            if (cnt[i] > 0 && to_double(run) < P) {
                last = threadIdx.x * PER + i;
                last_base = run;
            }
            run = add128(run, mass[i]);
        }
        // The last such bucket overall: the highest thread that has one.
        if (last >= 0) atomicMax(&bp_s, last);
        __syncthreads();
        if (last >= 0 && last == bp_s) base_s = last_base;
        __syncthreads();
        c.b = bp_s;
        int id_last;
        const double x_last = resolve(zrow, stats, V, G, c, 0u, base_s, P, &id_last, sh);
        sup.x_last = x_last;
        sup.id_last = id_last;
        sup.cut = 1;
    }
    if (threadIdx.x == 0) support[row] = sup;
}

// Step 11 per chunk: argmax over the support of z - log(-log(u)), u from Philox4x64-10 exactly as the reference
// draws it (bitwise the same u). The two logs are CUDA's float64 log (<= 1 ulp), so a score may differ from
// numpy's in its last bits: the token differs only if the two best scores are that close.
// Shortcuts that never change the argmax (only skip tokens that provably score below the max-z token, which
// is in the support and scores >= zmax - log(-log(2^-53)) = zmax - 3.6037):
//   - z < zmax - 41: its score is < z + 36.74 (the largest noise, u = 1 - 2^-53) < zmax - 4.2;
//   - otherwise, with d = zmax - 3.62 - z, beating that token needs -log(u) <= e^-d, and 1 - u <= -log(u),
//     so 1 - u > e^-d * 1.001 (fp32, margins >> rounding) rules the token out without computing its logs.
// Both are off when |zmax| >= 1e12, where float64 rounding of z would exceed the margins.
extern "C" __global__ void __launch_bounds__(CHUNK_THREADS) sampler_gumbel(
    const RowParams* __restrict__ rows, const double* __restrict__ zbuf, const ChunkStats* __restrict__ stats,
    const Support* __restrict__ support, Best* __restrict__ parts, int V, int G) {
    __shared__ double sv[33];
    __shared__ int si[33];
    const int chunk = blockIdx.x, row = blockIdx.y;
    const RowParams p = rows[row];
    if (p.flags & F_GREEDY) return;
    int arg;
    const double zmax = row_max<CHUNK_THREADS>(stats + (size_t)row * G, G, &arg, sv, si);
    const Support sup = support[row];
    const double* zrow = zbuf + (size_t)row * V;
    const bool prune = fabs(zmax) < 1e12;
    const double floor_z = __dsub_rn(zmax, 41.0), bound = __dsub_rn(zmax, 3.62);
    double best = -INF;
    int best_id = INT_MAX_;
    if (zmax > -INF) {
        for (int g = threadIdx.x; g < CHUNK / 4; g += CHUNK_THREADS) {  // ids increase along g
            const int t0 = chunk * CHUNK + 4 * g;
            double z[4];
            bool cand[4], any = false;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                z[i] = t0 + i < V ? zrow[t0 + i] : -INF;
                cand[i] = in_support(z[i], t0 + i, sup) && !(prune && z[i] < floor_z);
                any |= cand[i];
            }
            if (!any) continue;
            unsigned long long raw[4];
            philox4x64_10((unsigned long long)(t0 / 4), p.counter, p.stream, p.key, raw);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                if (!cand[i]) continue;
                const unsigned long long m = raw[i] >> 12;
                if (prune) {
                    const float one_minus_u = (float)(((double)((1ull << 52) - m) - 0.5) * 0x1p-52);
                    const float d = (float)__dsub_rn(bound, z[i]);
                    if (one_minus_u > __expf(-d) * 1.001f) continue;
                }
                const double u = ((double)m + 0.5) * 0x1p-52;
                const double s = __dsub_rn(z[i], log(-log(u)));
                if (s > best) {
                    best = s;
                    best_id = t0 + i;
                }
            }
        }
    }
    block_argmax<CHUNK_THREADS>(best, best_id, sv, si);
    if (threadIdx.x == 0) {
        Best b;
        b.score = best;
        b.id = best_id;
        b.pad = 0;
        parts[(size_t)row * G + chunk] = b;
    }
}

// The token (-1 when every token is masked or banned: the host raises the reference's SamplingError), and for
// logprob rows log_softmax of the raw logits (float64, max-shifted as the reference) at the token and the top N.
extern "C" __global__ void __launch_bounds__(CHUNK_THREADS) sampler_finalize(
    const RowParams* __restrict__ rows, const float* __restrict__ logits, const ChunkStats* __restrict__ stats_all,
    const TopEntry* __restrict__ tops, const Best* __restrict__ parts, int* __restrict__ tokens,
    double* __restrict__ token_logprobs, int* __restrict__ top_ids, double* __restrict__ top_logprobs, int V, int G) {
    __shared__ double sv[33];
    __shared__ int si[33];
    const int row = blockIdx.x;
    const RowParams p = rows[row];
    const ChunkStats* stats = stats_all + (size_t)row * G;
    int arg;
    const double zmax = row_max<CHUNK_THREADS>(stats, G, &arg, sv, si);
    int token = -1;
    if (zmax > -INF) {
        if (p.flags & F_GREEDY) {
            token = arg;  // step 6
        } else {
            double best = -INF;
            int id = INT_MAX_;
            for (int c = threadIdx.x; c < G; c += CHUNK_THREADS) {
                const Best b = parts[(size_t)row * G + c];
                if (better(b.score, b.id, best, id)) {
                    best = b.score;
                    id = b.id;
                }
            }
            block_argmax<CHUNK_THREADS>(best, id, sv, si);  // max score, then the lowest id
            token = best > -INF ? id : -1;
        }
    }
    bool bad = false;
    for (int c = threadIdx.x; c < G; c += CHUNK_THREADS) bad |= stats[c].nonfinite != 0;
    if (__syncthreads_or(bad)) token = -2;  // sampling.py NON_FINITE_LOGITS: the engine fails this request alone
    if (threadIdx.x == 0) tokens[row] = token;
    if (p.num_logprobs < 0) return;
    // log_softmax of the raw logits: max over the chunks, then sum of exp in a fixed tree over the chunks.
    double m = -INF;
    int unused = 0;
    for (int c = threadIdx.x; c < G; c += CHUNK_THREADS) m = fmax(m, stats[c].lmax);
    block_argmax<CHUNK_THREADS>(m, unused, sv, si);
    double partial = 0.0;
    for (int c = threadIdx.x; c < G; c += CHUNK_THREADS) {
        partial = __dadd_rn(partial, __dmul_rn(stats[c].lsum, exp(__dsub_rn(stats[c].lmax, m))));
    }
    const double log_sum = log(block_sum_double<CHUNK_THREADS>(partial, sv));
    if (threadIdx.x == 0) {
        const float* lrow = logits + (size_t)p.logit_row * V;
        token_logprobs[row] = token >= 0 ? __dsub_rn(__dsub_rn((double)lrow[token], m), log_sum) : 0.0;
    }
    if (p.num_logprobs == 0) return;
    // Merge the chunks' top-N lists: N rounds of a block argmax below the previous pick, over candidates held
    // in registers (MERGE per thread; a vocabulary past 256 * MERGE / MAX_TOP chunks reads the rest each round).
    constexpr int MERGE = 16;
    const TopEntry* cand = tops + (size_t)row * G * MAX_TOP;
    const int total = G * MAX_TOP;
    float cv[MERGE];
    int ci[MERGE];
#pragma unroll
    for (int i = 0; i < MERGE; ++i) {
        const int e = threadIdx.x + i * CHUNK_THREADS;
        const bool valid = e < total && e % MAX_TOP < p.num_logprobs;
        cv[i] = valid ? cand[e].value : 0.0f;
        ci[i] = valid ? cand[e].id : -1;
    }
    double prev_v = INF;
    int prev_id = -1;
    for (int k = 0; k < p.num_logprobs; ++k) {
        double v = -INF;
        int id = INT_MAX_;
        auto consider = [&](float value, int cid) {
            const double x = (double)value;
            const bool below = x < prev_v || (x == prev_v && cid > prev_id);
            if (cid >= 0 && below && better(x, cid, v, id)) {
                v = x;
                id = cid;
            }
        };
#pragma unroll
        for (int i = 0; i < MERGE; ++i) consider(cv[i], ci[i]);
        for (int e = threadIdx.x + MERGE * CHUNK_THREADS; e < total; e += CHUNK_THREADS) {
            if (e % MAX_TOP < p.num_logprobs) consider(cand[e].value, cand[e].id);
        }
        block_argmax<CHUNK_THREADS>(v, id, sv, si);
        if (threadIdx.x == 0) {
            top_ids[(size_t)row * MAX_TOP + k] = id == INT_MAX_ ? -1 : id;
            top_logprobs[(size_t)row * MAX_TOP + k] = id == INT_MAX_ ? 0.0 : __dsub_rn(__dsub_rn(v, m), log_sum);
        }
        prev_v = v;
        prev_id = id;
    }
}
