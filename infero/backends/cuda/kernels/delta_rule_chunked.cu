// delta_rule_chunked: the gated delta rule over a step's whole 64-position chunks (delta_chunks.cuh says which
// tokens those are), in the WY form of tests/cpu/test_delta_rule_chunked.py's transcription, on the tensor cores,
// in two launches: delta_rule_prepare computes for every chunk at once what does not depend on the state S, and
// delta_rule_chunked walks each sequence's chunks in order with S resident, doing only S's three products. The
// recurrent kernel (delta_net.cu's gated_delta_rule) takes the step's other tokens, before (part head) and after
// (part tail) these launches, on the same state.
//
// Layouts as gated_delta_rule's: q, k [n, key heads x DK] (rows q_stride, k_stride apart, read in place), v [n,
// value heads x dv] (rows v_stride apart), g, beta [n, value heads] -> out [n, value heads, dv]; the slot's S
// [value heads, DK, dv] (delta_state [slots, layers, value heads, DK, dv]) updated in place. Value head h reads key
// head h % key_heads (tiled) or h / (value heads / key heads) (grouped); q is scaled by `scale` as it is read. A
// slot outside [0, num_slots): NaN outputs for the chunks' tokens, no state touched.
//
// The chunk. With G the cumulative log decay (inclusive, from the chunk's start), D[i, j] = exp(G_i - G_j) for
// j <= i, L = strictly lower (beta_i k_i.k_j D_ij) and T = (I + L)^-1:
//   W = T diag(beta exp(G)) k, A = T diag(beta) v, P = (q k^T * D, lower),
//   Q' = exp(G) q - P W, O' = P A, Kt = exp(G_last - G) k;
// then with S the state before the chunk: u = A - W S; o = Q' S + O' (= exp(G) q S + P u); S <- exp(G_last) S +
// Kt^T u. T is applied by blocks of 16 rows: each diagonal block's inverse T_r = (I + L_rr)^-1 by forward
// substitution (a thread a column, fp32), then X_r = T_r (rhs_r - sum over s < r of L_rs X_s), slab after slab.
//
// The records. delta_rule_prepare writes a chunk's -W, Q', Kt^T, A, O' and exp(G_last) to its record in `records`
// (the op's workspace, Record<DK>::floats(dv) = 192 DK + 128 dv + 4 floats a (chunk, value head)): record (j, h)
// at j x value heads + h, the chunk of sequence s that starts at its step token head + 64 c in record j =
// starts[s] / 64 + c (a sequence's whole chunks fit below the next one's first record: starts[s] / 64 + chunks <=
// starts[s + 1] / 64, so n / 64 records take a step of n tokens). -W, Q' and Kt^T are stored as the walk's mma A
// fragments (per 16-row slab and k-step, a lane's four floats together: one 16-byte load each), A and O' in its
// accumulator order (per 32-column block and slab, a lane's four n8 tiles' sixteen floats); W negated so that u is
// A + (-W) S, accumulated from A.
//
// Work. delta_rule_prepare: grid (value heads, n / 64 records), 256 threads, a block a chunk (blocks of records no
// sequence fills return): warps 0-3 take k k^T's 16-row slabs (L), warps 4-7 q k^T's (P, in registers until L is
// dead), slabs paired so that each SM sub-partition gets one light and one heavy; warps 0-1 invert the diagonal
// blocks; the 8 warps solve 16-column strips of [W | A], then n8 tiles of [Q' | O']. delta_rule_chunked: grid (value
// heads x dv / 32, seqs), 256 threads, a block one (sequence, value head, 32 columns of S); per chunk warps 0-3
// take the 16-row slabs of u = A - W S, warps 4-7 those of o = O' + Q' S (accumulators started at A and O'), u goes
// to shared memory, then every warp updates its 16 x 8 ST tiles of S (mma accumulators, S read once and written
// once) by Kt^T u. Its operands stream from the records into registers LEAD 16-byte loads ahead of their use,
// across chunk boundaries, and each chunk asks L2 for the next one's records (from memory where a long step's
// records outgrow L2), so the next chunk's operands arrive while the current one computes; S and u are stored in
// shared memory already split (below), the B operand of every warp. Every product is mma.sync m16n8k8 TF32 in the
// 3xTF32 split (x = big + small, big = tf32(x), small = tf32(x - big); a b ~ big small + small big + big big, fp32
// accumulators): fp32-level accuracy from tensor cores whose one TF32 product keeps 11 bits.
//
// Shared memory: delta_rule_prepare (Prep<DK>) 84 KiB at DK 128, 68 at 64; delta_rule_chunked (Walk<DK>) 48 KiB
// at DK 128, 32 at 64 (two blocks an SM on every target, sm_89's 100 KiB included): within every target's
// per-block limit (sm_86 / sm_89 99 KiB, sm_80 163 KiB, sm_90 227 KiB). Fragment reads hit every bank once: [k | v]
// rows of DK + 136 floats (B reads; k k^T's A and transposed reads two-way), the system's rows of 68, split S and u
// by an xor of the column (Walk).
//
// Reduction order (batch invariance). A chunk's record depends only on the chunk's q, k, v, g and beta, and its
// walk only on the record and the S before it: every sum has one order fixed by DK (the mma k-steps in increasing
// order, the three TF32 products in a fixed order), nothing depends on the batch, the record's index or other
// sequences, and S passes between chunks as fp32, in registers within a step and through memory between steps,
// the same bits either way. So a prompt's chunks give the same output and state bits in one step or split at
// multiples of 64 (tests/cuda/test_delta_rule_chunked_cuda.py). The numbers differ from the recurrent form's within
// fp32 accuracy (tests/cpu/test_delta_rule_chunked.py: a numpy transcription with TF32 rounding against float64).
//
// Resources (ptxas -v, 2026-12-03; no spill, no stack on sm_80, sm_89, sm_90a): delta_rule_chunked 128 registers
// at DK 128 and 64 (launch bounds of two blocks an SM; SASS of its chunk loop on sm_90a: 1,208 instructions, 288 of
// them HMMA, at DK 128; 812 at 64), delta_rule_prepare 118-119 (sm_90a). Speed (H200, 2026-12-03, 43ae389): the two
// launches take 3.84 ms of Qwen3.5-35B-A3B's 512-token prefill over its 30 layers (16 us a chunk of a layer, both
// kernels together, events included); the GPU tests pass there. The one-kernel form it replaced (a block per 32 columns doing
// the S-free products too, 242 registers, one block an SM) took 25 us a chunk on the H200 (2026-12-03): 6.0 ms for
// Qwen3.5-35B-A3B's 30 layers over a 512-token prompt.
#include "delta_chunks.cuh"
#include "pdl.cuh"
#include "tensor_core.cuh"

namespace drc {
constexpr int CHUNK = dchunk::CHUNK;
constexpr int COLS = 32;  // columns of S a walking block takes
constexpr int WARPS = 8;
constexpr int THREADS = 32 * WARPS;
constexpr int SLABS = CHUNK / 16;     // 16-token slabs: the rows of one m16 fragment
constexpr int TILES = COLS / 8;       // n8 tiles of a walking block's columns
constexpr int PAD_CHUNK = CHUNK + 4;  // the system's rows
constexpr int MAX_DV = 128;           // delta_net.MAX_DV: the prepare block's v columns

// A record's parts (floats from its start); DK x 64 each for W, Q' and Kt^T, dv x 64 for A and O'.
template <int DK>
struct Record {
    static constexpr int W = 0, Q = 64 * DK, K = 128 * DK, A = 192 * DK;
    static constexpr __host__ __device__ int o(int dv) { return A + 64 * dv; }
    static constexpr __host__ __device__ int decay(int dv) { return A + 128 * dv; }  // exp(G_last), 3 unused
    static constexpr __host__ __device__ int floats(int dv) { return A + 128 * dv + 4; }
};

template <int DK>
struct Prep {
    float x[CHUNK][DK + MAX_DV + 8];  // [k | v], scaled into the right-hand sides, then [W | A]
    float l[CHUNK][PAD_CHUNK];        // L below the diagonal blocks, T_r on them; then P
    float eg[CHUNK];                  // exp(G_i)
    float eg_rest[CHUNK];             // exp(G_last - G_i)
    float cum[CHUNK];                 // G_i
    float beta[CHUNK];
};

// S and u as B operands: element [k][n] split, in the float4 [k / 8][k % 4][n ^ 2 (k % 4)] of a lane's whole B
// fragment (big(k), big(k + 4), small(k), small(k + 4)), k % 8 < 4: one 16-byte load a fragment, in mma's
// register order. The xor spreads each 8-lane phase of a fragment load (k % 4 = lane % 4, n = lane / 4) over all
// 32 banks.
template <int DK>
struct Walk {
    float4 s[DK / 8][4][COLS];     // S's column block at the chunk's start
    float4 u[CHUNK / 8][4][COLS];  // the chunk's u
};

// A fragment as two TF32 parts (mma.m16n8k8: A 4 registers, B 2).
template <int N>
struct Split {
    unsigned big[N], small[N];
};

// cvt.rna.tf32.f32 for finite x (the nearest float with 10 mantissa bits, ties away from zero) as an integer add
// and mask: the instruction compiles to those plus a compare and a select (NaN), and with it the chunk loop of
// the one-kernel form took 10,868 SASS instructions against 8,202 (sm_90a, scripts/kernel_resources.py --sass).
__device__ __forceinline__ unsigned tf32(float x) { return (__float_as_uint(x) + 0x1000u) & 0xffffe000u; }

// x - tf32(x) (exact in fp32: at most 12 significant bits) rounded again.
__device__ __forceinline__ unsigned tf32_rest(float x, unsigned big) {
    return tf32(__fsub_rn(x, __uint_as_float(big)));
}

template <int N>
__device__ __forceinline__ Split<N> split(const float (&x)[N]) {
    Split<N> s;
#pragma unroll
    for (int i = 0; i < N; ++i) {
        s.big[i] = tf32(x[i]);
        s.small[i] = tf32_rest(x[i], s.big[i]);
    }
    return s;
}

__device__ __forceinline__ void mma_tf32(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// d += a b in 3xTF32, the two small products first.
__device__ __forceinline__ void mma3(float (&d)[4], const Split<4>& a, const Split<2>& b) {
    mma_tf32(d, a.small, b.big);
    mma_tf32(d, a.big, b.small);
    mma_tf32(d, a.big, b.big);
}

// The A fragment (rows r0 + lane / 4 (+ 8), columns c0 + lane % 4 (+ 4)) of a row-major array, times sign.
template <int STRIDE>
__device__ __forceinline__ Split<4> a_frag(const float* base, int r0, int c0, int lane, float sign = 1.0f) {
    const float* p = base + (r0 + lane / 4) * STRIDE + c0 + lane % 4;
    const float x[4] = {sign * p[0], sign * p[8 * STRIDE], sign * p[4], sign * p[8 * STRIDE + 4]};
    return split(x);
}

// The B fragment (k rows k0 + lane % 4 (+ 4), column n0 + lane / 4) of a row-major [k][n] array.
template <int STRIDE>
__device__ __forceinline__ Split<2> b_frag(const float* base, int k0, int n0, int lane) {
    const float* p = base + (k0 + lane % 4) * STRIDE + n0 + lane / 4;
    const float x[2] = {p[0], p[4 * STRIDE]};
    return split(x);
}

// The B fragment of the transpose of a row-major [n][k] array: B[k][n] = base[n][k].
template <int STRIDE>
__device__ __forceinline__ Split<2> bt_frag(const float* base, int k0, int n0, int lane) {
    const float* p = base + (n0 + lane / 4) * STRIDE + k0 + lane % 4;
    const float x[2] = {p[0], p[4]};
    return split(x);
}

// The B fragment (k rows 8 ks + lane % 4 (+ 4), column n0 + lane / 4; n0 a multiple of 8) of a split array.
__device__ __forceinline__ Split<2> b_split(const float4 (*base)[4][COLS], int ks, int n0, int lane) {
    const float4 x = base[ks][lane % 4][n0 + (lane / 4 ^ 2 * (lane % 4))];
    return {{__float_as_uint(x.x), __float_as_uint(x.y)}, {__float_as_uint(x.z), __float_as_uint(x.w)}};
}

// Element [k][n] into a split array.
__device__ __forceinline__ void store_split(float4 (*base)[4][COLS], int k, int n, float x) {
    float* p = &base[k / 8][k % 4][n ^ 2 * (k % 4)].x + k / 4 % 2;
    const unsigned big = tf32(x);
    p[0] = __uint_as_float(big);
    p[2] = __uint_as_float(tf32_rest(x, big));
}

// Accumulator tile t (16 rows x 8 columns; thread (g, c) holds columns 2 c, 2 c + 1) as the A fragment of the
// k-step over its columns (thread (g, c) wants c and c + 4): each from the lane that holds it.
__device__ __forceinline__ float4 acc_to_a(const float (&c)[4], int lane) {
    const int src = (lane & ~3) | ((lane & 3) >> 1);
    const bool odd = lane & 1;
    float x[4];
#pragma unroll
    for (int half = 0; half < 2; ++half) {  // columns c (from src), c + 4 (from src + 2)
        const int from = src + 2 * half;
        const float lo0 = __shfl_sync(0xffffffffu, c[0], from), lo1 = __shfl_sync(0xffffffffu, c[1], from);
        const float hi0 = __shfl_sync(0xffffffffu, c[2], from), hi1 = __shfl_sync(0xffffffffu, c[3], from);
        x[2 * half] = odd ? lo1 : lo0;      // row g
        x[2 * half + 1] = odd ? hi1 : hi0;  // row g + 8
    }
    return make_float4(x[0], x[1], x[2], x[3]);
}

// Accumulator element e of tile (row r0, column c0) in this lane: its row and column.
__device__ __forceinline__ int acc_row(int r0, int lane, int e) { return r0 + lane / 4 + 8 * (e >> 1); }
__device__ __forceinline__ int acc_col(int c0, int lane, int e) { return c0 + 2 * (lane % 4) + (e & 1); }

// `floats` floats (a multiple of 32) from p into L2, a 128-byte line a lane at a time.
__device__ __forceinline__ void prefetch_l2(const float* p, int floats, int lane) {
    for (int i = 32 * lane; i < floats; i += 32 * 32) asm volatile("prefetch.global.L2 [%0];" ::"l"(p + i));
}

__device__ __forceinline__ void store4(float* p, float a, float b, float c, float d) {
    *reinterpret_cast<float4*>(p) = make_float4(a, b, c, d);
}
}  // namespace drc

// One chunk's record (the launch's blockIdx.y: the record index) for value head blockIdx.x.
template <int DK>
__global__ void __launch_bounds__(drc::THREADS, 2) delta_rule_prepare(
    float* __restrict__ records, const float* __restrict__ q, const float* __restrict__ k,
    const float* __restrict__ v, const float* __restrict__ g, const float* __restrict__ beta,
    const int* __restrict__ starts, const int* __restrict__ positions, const int* __restrict__ slots, float scale,
    int seqs, int num_slots, int key_heads, int v_heads, int dv, int q_stride, int k_stride, int v_stride,
    int tiled) {
    using namespace drc;
    static_assert(DK == 64 || DK == 128, "W, Q' and Kt^T by 16-row slabs and 8-column k-steps");
    constexpr int XS = DK + MAX_DV + 8, KS = DK / 8;
    using R = Record<DK>;
    extern __shared__ __align__(16) unsigned char smem[];
    Prep<DK>& sm = *reinterpret_cast<Prep<DK>*>(smem);
    pdl_enter();
    const int h = blockIdx.x, j = blockIdx.y, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    // The record's sequence: the last whose first record (starts / 64) is at most j.
    int before = 0;
    for (int s = lane; s < seqs; s += 32) before += starts[s] < CHUNK * (j + 1);
    const int seq = __reduce_add_sync(0xffffffffu, before) - 1;
    const int lo = starts[seq], n = starts[seq + 1] - lo, slot = slots[seq];
    if (n <= 0 || slot < 0 || slot >= num_slots) return;
    int head, tail;
    dchunk::whole_chunks(positions[lo], n, head, tail);
    const int t0 = lo + head + CHUNK * (j - lo / CHUNK);
    if (t0 >= lo + tail) return;
    const int kh = tiled ? h % key_heads : h / (v_heads / key_heads);
    float* rec = records + ((size_t)j * v_heads + h) * R::floats(dv);

    for (int e = threadIdx.x; e < CHUNK * DK; e += THREADS)
        tc::cp_async<4>(&sm.x[e / DK][e % DK], k + (size_t)(t0 + e / DK) * k_stride + kh * DK + e % DK);
    for (int e = threadIdx.x; e < CHUNK * dv; e += THREADS)
        tc::cp_async<4>(&sm.x[e / dv][DK + e % dv], v + (size_t)(t0 + e / dv) * v_stride + (size_t)h * dv + e % dv);
    tc::cp_async_commit();
    if (warp == 0) {  // G by an inclusive scan over the lanes (tokens lane and 32 + lane), then its exps
        const float* gp = g + (size_t)t0 * v_heads + h;
        float x0 = gp[(size_t)lane * v_heads], x1 = gp[(size_t)(32 + lane) * v_heads];
#pragma unroll
        for (int d = 1; d < 32; d <<= 1) {
            const float y0 = __shfl_up_sync(0xffffffffu, x0, d), y1 = __shfl_up_sync(0xffffffffu, x1, d);
            if (lane >= d) {
                x0 = __fadd_rn(x0, y0);
                x1 = __fadd_rn(x1, y1);
            }
        }
        x1 = __fadd_rn(x1, __shfl_sync(0xffffffffu, x0, 31));
        const float last = __shfl_sync(0xffffffffu, x1, 31);
        sm.cum[lane] = x0;
        sm.cum[32 + lane] = x1;
        sm.eg[lane] = expf(x0);
        sm.eg[32 + lane] = expf(x1);
        sm.eg_rest[lane] = expf(__fsub_rn(last, x0));
        sm.eg_rest[32 + lane] = expf(__fsub_rn(last, x1));
        sm.beta[lane] = beta[(size_t)(t0 + lane) * v_heads + h];
        sm.beta[32 + lane] = beta[(size_t)(t0 + 32 + lane) * v_heads + h];
        if (lane == 31) rec[R::decay(dv)] = expf(x1);
    }
    tc::cp_async_wait<0>();
    __syncthreads();

    // Warps 0-3 (K warps): k's slab w times k^T up to its diagonal block, giving L's rows. Warps 4-7: q's slab
    // 7 - w, giving P's rows, kept in registers until L is dead.
    const bool k_warp = warp < 4;
    const int slab = k_warp ? warp : 7 - warp, row0 = 16 * slab, kk_tiles = 2 * slab + 2;
    float kk[2 * SLABS][4] = {};
    const float* qp = q + (size_t)(t0 + row0 + lane / 4) * q_stride + kh * DK + lane % 4;
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
        Split<4> a;
        if (k_warp) {
            a = a_frag<XS>(&sm.x[0][0], row0, 8 * ks, lane);
        } else {
            const float x[4] = {__fmul_rn(qp[8 * ks], scale), __fmul_rn(qp[8 * (size_t)q_stride + 8 * ks], scale),
                                __fmul_rn(qp[8 * ks + 4], scale),
                                __fmul_rn(qp[8 * (size_t)q_stride + 8 * ks + 4], scale)};
            a = split(x);
        }
#pragma unroll
        for (int t = 0; t < 2 * SLABS; ++t)
            if (t < kk_tiles) mma3(kk[t], a, bt_frag<XS>(&sm.x[0][0], 8 * ks, 8 * t, lane));
    }
#pragma unroll
    for (int t = 0; t < 2 * SLABS; ++t)
        if (t < kk_tiles)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int i = acc_row(row0, lane, e), c = acc_col(8 * t, lane, e);
                const bool below = k_warp ? c < i : c <= i;
                const float x = below ? kk[t][e] * expf(__fsub_rn(sm.cum[i], sm.cum[c])) : 0.0f;
                if (k_warp)
                    sm.l[i][c] = sm.beta[i] * x;
                else
                    kk[t][e] = x;
            }
    // Kt^T's A fragments (rows d = 16 ds + lane / 4 (+ 8), tokens 8 ks + lane % 4 (+ 4)) before k is scaled.
    for (int f = threadIdx.x; f < DK / 16 * (CHUNK / 8) * 32; f += THREADS) {
        const int d = f / 256 * 16 + f % 32 / 4, t = f / 32 % 8 * 8 + f % 4;
        store4(rec + R::K + 4 * f, sm.eg_rest[t] * sm.x[t][d], sm.eg_rest[t] * sm.x[t][d + 8],
               sm.eg_rest[t + 4] * sm.x[t + 4][d], sm.eg_rest[t + 4] * sm.x[t + 4][d + 8]);
    }
    __syncthreads();

    // The diagonal blocks' inverses T_r = (I + L_rr)^-1, a thread a column: (I + L_rr) x = e_j by forward
    // substitution, then written over L_rr. The other warps scale the right-hand sides: beta exp(G) k, beta v.
    if (warp < 2) {
        const int b = 16 * (2 * warp + lane / 16), c = lane % 16;
        float x[16];
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            float sum = 0.0f;
#pragma unroll
            for (int m = 0; m < i; ++m) sum = fmaf(sm.l[b + i][b + m], x[m], sum);
            x[i] = i < c ? 0.0f : (i == c ? 1.0f : -sum);
        }
        __syncwarp();
#pragma unroll
        for (int i = 0; i < 16; ++i) sm.l[b + i][b + c] = x[i];
    } else {
        for (int e = threadIdx.x - 64; e < CHUNK * (DK + dv); e += THREADS - 64) {
            const int i = e / (DK + dv), c = e % (DK + dv);
            sm.x[i][c] *= c < DK ? sm.beta[i] * sm.eg[i] : sm.beta[i];
        }
    }
    __syncthreads();

    // [W | A] by 16-column strips (two n8 tiles: two chains of mma in flight), warp w the strips w, w + 8, ...,
    // slab by slab: X_r = T_r (rhs_r - sum over s < r of L_rs X_s).
    for (int n0 = 16 * warp; n0 < DK + dv; n0 += 16 * WARPS) {
#pragma unroll
        for (int r = 0; r < SLABS; ++r) {
            float w[2][4];
#pragma unroll
            for (int t = 0; t < 2; ++t)
#pragma unroll
                for (int e = 0; e < 4; ++e) w[t][e] = sm.x[acc_row(16 * r, lane, e)][acc_col(n0 + 8 * t, lane, e)];
#pragma unroll
            for (int ks = 0; ks < 2 * r; ++ks) {
                const Split<4> a = a_frag<PAD_CHUNK>(&sm.l[0][0], 16 * r, 8 * ks, lane, -1.0f);
#pragma unroll
                for (int t = 0; t < 2; ++t) mma3(w[t], a, b_frag<XS>(&sm.x[0][0], 8 * ks, n0 + 8 * t, lane));
            }
#pragma unroll
            for (int t = 0; t < 2; ++t)
#pragma unroll
                for (int e = 0; e < 4; ++e) sm.x[acc_row(16 * r, lane, e)][acc_col(n0 + 8 * t, lane, e)] = w[t][e];
            __syncwarp();
            float xr[2][4] = {};
#pragma unroll
            for (int ks = 0; ks < 2; ++ks) {
                const Split<4> a = a_frag<PAD_CHUNK>(&sm.l[0][0], 16 * r, 16 * r + 8 * ks, lane);
#pragma unroll
                for (int t = 0; t < 2; ++t)
                    mma3(xr[t], a, b_frag<XS>(&sm.x[0][0], 16 * r + 8 * ks, n0 + 8 * t, lane));
            }
            __syncwarp();
#pragma unroll
            for (int t = 0; t < 2; ++t)
#pragma unroll
                for (int e = 0; e < 4; ++e) sm.x[acc_row(16 * r, lane, e)][acc_col(n0 + 8 * t, lane, e)] = xr[t][e];
            __syncwarp();
        }
    }
    __syncthreads();

    // L is dead: P into its place. W's A fragments and A's accumulator order into the record.
    if (!k_warp)
#pragma unroll
        for (int t = 0; t < 2 * SLABS; ++t)
            if (t < kk_tiles)
#pragma unroll
                for (int e = 0; e < 4; ++e) sm.l[acc_row(row0, lane, e)][acc_col(8 * t, lane, e)] = kk[t][e];
    for (int f = threadIdx.x; f < SLABS * KS * 32; f += THREADS) {
        const int i = f / (32 * KS) * 16 + f % 32 / 4, d = f / 32 % KS * 8 + f % 4;
        store4(rec + R::W + 4 * f, -sm.x[i][d], -sm.x[i + 8][d], -sm.x[i][d + 4], -sm.x[i + 8][d + 4]);
    }
    for (int f = threadIdx.x; f < dv / COLS * SLABS * 32 * TILES; f += THREADS) {  // [col block][slab][lane][tile]
        const int lane_f = f / TILES % 32, i = f / (TILES * 32) % SLABS * 16 + lane_f / 4;
        const int c = DK + f / (TILES * 32 * SLABS) * COLS + f % TILES * 8 + 2 * (lane_f % 4);
        store4(rec + R::A + 4 * f, sm.x[i][c], sm.x[i][c + 1], sm.x[i + 8][c], sm.x[i + 8][c + 1]);
    }
    __syncthreads();

    // [Q' | O'] by n8 tiles, warp w the tiles w, w + 8, ...: Q' = exp(G) q - P W, O' = P A, the four slabs' sums
    // side by side (slab r over the tokens up to its end).
    for (int n0 = 8 * warp; n0 < DK + dv; n0 += 8 * WARPS) {
        const bool q_tile = n0 < DK;
        float acc[SLABS][4];
#pragma unroll
        for (int r = 0; r < SLABS; ++r)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int i = acc_row(16 * r, lane, e);
                const float* qi = q + (size_t)(t0 + i) * q_stride + kh * DK;
                acc[r][e] = q_tile ? sm.eg[i] * __fmul_rn(qi[acc_col(n0, lane, e)], scale) : 0.0f;
            }
#pragma unroll
        for (int ks = 0; ks < 2 * SLABS; ++ks) {
            const Split<2> b = b_frag<XS>(&sm.x[0][0], 8 * ks, n0, lane);
#pragma unroll
            for (int r = 0; r < SLABS; ++r)
                if (ks < 2 * r + 2)
                    mma3(acc[r], a_frag<PAD_CHUNK>(&sm.l[0][0], 16 * r, 8 * ks, lane, q_tile ? -1.0f : 1.0f), b);
        }
#pragma unroll
        for (int r = 0; r < SLABS; ++r)
            if (q_tile) {  // as the A fragment of k-step n0 / 8
                const float4 a = acc_to_a(acc[r], lane);
                store4(rec + R::Q + ((r * KS + n0 / 8) * 32 + lane) * 4, a.x, a.y, a.z, a.w);
            } else {
                const int c = n0 - DK;
                store4(rec + R::o(dv) + (((c / COLS * SLABS + r) * 32 + lane) * TILES + c % COLS / 8) * 4, acc[r][0],
                       acc[r][1], acc[r][2], acc[r][3]);
            }
    }
}

// The walk: a block one (sequence, value head, 32 columns of S) through the sequence's whole chunks in order.
template <int DK>
__global__ void __launch_bounds__(drc::THREADS, 2) delta_rule_chunked(
    float* __restrict__ out, const float* __restrict__ records, float* __restrict__ delta_state,
    const int* __restrict__ starts, const int* __restrict__ positions, const int* __restrict__ slots,
    int num_slots, int layers, int layer, int v_heads, int dv) {
    using namespace drc;
    static_assert(DK == 64 || DK == 128, "S's DK rows: 16 x 8 ST tiles of it a warp");
    // A lane's NP 16-byte loads a chunk, in the order it uses them: its u or o tiles' start (A or O'), its slab's
    // k-steps of W or Q', its S rows' k-steps of Kt^T. LEAD divides NP, so a load's register is known at compile
    // time in every chunk; 4 keeps two blocks an SM (124 registers at DK 128 on sm_90a; 7 spilled at 128).
    constexpr int WARPS_A_SLAB = 128 / DK, ST = TILES / WARPS_A_SLAB, KS = DK / 8, NP = TILES + KS + CHUNK / 8;
    constexpr int LEAD = 4;
    static_assert(NP % LEAD == 0, "a load's register the same in every chunk");
    using R = Record<DK>;
    extern __shared__ __align__(16) unsigned char smem[];
    Walk<DK>& sm = *reinterpret_cast<Walk<DK>*>(smem);
    pdl_enter();
    const int col_blocks = dv / COLS;
    const int h = blockIdx.x / col_blocks, cb = blockIdx.x % col_blocks, c0 = cb * COLS, seq = blockIdx.y;
    const int lo = starts[seq], n = starts[seq + 1] - lo;
    if (n <= 0) return;
    int head, tail;
    dchunk::whole_chunks(positions[lo], n, head, tail);
    if (head == tail) return;
    const int slot = slots[seq], warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const size_t out_row = (size_t)v_heads * dv;
    float* o = out + (size_t)h * dv + c0;
    if (slot < 0 || slot >= num_slots) {
        for (int e = threadIdx.x; e < (tail - head) * COLS; e += THREADS)
            o[(size_t)(lo + head + e / COLS) * out_row + e % COLS] = __int_as_float(0x7fc00000);
        return;
    }
    float* state = delta_state + (((size_t)slot * layers + layer) * v_heads + h) * DK * dv + c0;

    // This warp's tiles of S: rows s_row .. + 15, ST n8 tiles from column s_col.
    const int s_row = warp / WARPS_A_SLAB * 16, s_col = warp % WARPS_A_SLAB * 8 * ST;
    float s_acc[ST][4];
#pragma unroll
    for (int t = 0; t < ST; ++t) {
#pragma unroll
        for (int e = 0; e < 4; ++e)
            s_acc[t][e] = state[(size_t)acc_row(s_row, lane, e) * dv + acc_col(s_col + 8 * t, lane, e)];
#pragma unroll
        for (int e = 0; e < 4; ++e)
            store_split(sm.s, acc_row(s_row, lane, e), acc_col(s_col + 8 * t, lane, e), s_acc[t][e]);
    }

    const bool k_warp = warp < 4;
    const int slab = warp % 4, chunks = (tail - head) / CHUNK;
    const size_t record = R::floats(dv), next_record = (size_t)v_heads * record;
    const float* rec0 = records + ((size_t)(lo / CHUNK) * v_heads + h) * record;
    // This lane's first load of each kind in the sequence's first record (offsets within a record in floats).
    const float* starts_at = rec0 + (k_warp ? R::A : R::o(dv)) + ((cb * SLABS + slab) * 32 + lane) * TILES * 4;
    const float* w_at = rec0 + (k_warp ? R::W : R::Q) + (slab * KS * 32 + lane) * 4;
    const float* kt_at = rec0 + R::K + (s_row / 16 * (CHUNK / 8) * 32 + lane) * 4;
    auto load = [&](int c, int p) {  // chunk c's load p
        const size_t at = c * next_record;
        const float* f = p < TILES ? starts_at + at + 4 * p
                         : p < TILES + KS ? w_at + at + 128 * (p - TILES) : kt_at + at + 128 * (p - TILES - KS);
        return __ldcg(reinterpret_cast<const float4*>(f));
    };
    float4 ahead[LEAD];
#pragma unroll
    for (int p = 0; p < LEAD; ++p) ahead[p] = load(0, p);
    __syncthreads();

    for (int c = 0; c < chunks; ++c) {
        const float eg_last = __ldcg(rec0 + c * next_record + R::decay(dv));
        if (c + 1 < chunks) {  // the warp's next-chunk records into L2 (from memory, where a long step's spill)
            const size_t next = (c + 1) * next_record;
            prefetch_l2(starts_at + next - lane * TILES * 4, 32 * TILES * 4, lane);
            prefetch_l2(w_at + next - lane * 4, 32 * KS * 4, lane);
            prefetch_l2(kt_at + next - lane * 4, 32 * (CHUNK / 8) * 4, lane);
        }
        auto take = [&](int p) {  // chunk c's load p, its register then loading p + LEAD
            const float4 f = ahead[p % LEAD];
            if (p + LEAD < NP)
                ahead[p % LEAD] = load(c, p + LEAD);
            else if (c + 1 < chunks)
                ahead[p % LEAD] = load(c + 1, p + LEAD - NP);
            return f;
        };

        // Warps 0-3: u = A - W S; warps 4-7: o = O' + Q' S, over this warp's slab and the block's columns.
        float x[TILES][4];
#pragma unroll
        for (int t = 0; t < TILES; ++t) {
            const float4 f = take(t);
            x[t][0] = f.x, x[t][1] = f.y, x[t][2] = f.z, x[t][3] = f.w;
        }
#pragma unroll
        for (int ks = 0; ks < KS; ++ks) {
            const float4 f = take(TILES + ks);
            const float w[4] = {f.x, f.y, f.z, f.w};
            const Split<4> a = split(w);
#pragma unroll
            for (int t = 0; t < TILES; ++t) mma3(x[t], a, b_split(sm.s, ks, 8 * t, lane));
        }
        const int t0 = lo + head + CHUNK * c;
#pragma unroll
        for (int t = 0; t < TILES; ++t)
#pragma unroll
            for (int e = 0; e < 4; e += 2) {
                const int i = acc_row(16 * slab, lane, e), col = acc_col(8 * t, lane, e);
                if (k_warp) {
                    store_split(sm.u, i, col, x[t][e]);
                    store_split(sm.u, i, col + 1, x[t][e + 1]);
                } else {
                    float* row = o + (size_t)(t0 + i) * out_row;
                    *reinterpret_cast<float2*>(row + col) = make_float2(x[t][e], x[t][e + 1]);
                }
            }
        __syncthreads();

        // Every warp: its tiles of S <- exp(G_last) S + Kt^T u, then their split copy for the next chunk.
#pragma unroll
        for (int t = 0; t < ST; ++t)
#pragma unroll
            for (int e = 0; e < 4; ++e) s_acc[t][e] *= eg_last;
#pragma unroll
        for (int ks = 0; ks < CHUNK / 8; ++ks) {
            const float4 f = take(TILES + KS + ks);
            const float kt[4] = {f.x, f.y, f.z, f.w};
            const Split<4> a = split(kt);
#pragma unroll
            for (int t = 0; t < ST; ++t) mma3(s_acc[t], a, b_split(sm.u, ks, s_col + 8 * t, lane));
        }
#pragma unroll
        for (int t = 0; t < ST; ++t)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                store_split(sm.s, acc_row(s_row, lane, e), acc_col(s_col + 8 * t, lane, e), s_acc[t][e]);
        __syncthreads();  // the next chunk reads S and overwrites u
    }
#pragma unroll
    for (int t = 0; t < ST; ++t)
#pragma unroll
        for (int e = 0; e < 4; ++e)
            state[(size_t)acc_row(s_row, lane, e) * dv + acc_col(s_col + 8 * t, lane, e)] = s_acc[t][e];
}
