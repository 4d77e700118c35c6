// delta_rule_chunked: the gated delta rule over a step's whole 64-position chunks (delta_chunks.cuh says which
// tokens those are), in the chunked form of backends/cpu/delta_net.py's delta_rule_chunked, on the tensor cores.
// The recurrent kernel (delta_net.cu's gated_delta_rule) takes the step's other tokens, before (part head) and
// after (part tail) this launch, on the same state.
//
// Layouts as gated_delta_rule's: q, k [n, key heads x DK] (rows q_stride, k_stride apart, read in place), v [n,
// value heads x dv] (rows v_stride apart), g, beta [n, value heads] -> out [n, value heads, dv]; the slot's S
// [value heads, DK, dv] (delta_state [slots, layers, value heads, DK, dv]) updated in place. Value head h reads key
// head h % key_heads (tiled) or h / (value heads / key heads) (grouped); q is scaled by `scale` as it is read. A
// slot outside [0, num_slots): NaN outputs for the chunks' tokens, no state touched.
//
// Per chunk, with G the cumulative log decay (inclusive, from the chunk's start), D[i, j] = exp(G_i - G_j) for
// j <= i, S the state before the chunk:
//   L = strictly lower (beta_i k_i.k_j D_ij); rhs = beta (v - exp(G) k S); (I + L) u = rhs
//   o = exp(G) q S + (q k^T * D, lower) u;  S <- exp(G_last) S + (exp(G_last - G) k)^T u
// The triangular system by blocks of 16 rows: each diagonal block's inverse T_r = (I + L_rr)^-1 by forward
// substitution (a thread a column, fp32), then u_r = T_r (rhs_r - sum over s < r of L_rs u_s), slab after slab.
//
// Work. grid (value heads x dv / 32, seqs), 256 threads: a block takes one (sequence, value head, 32 columns of
// S) and walks the sequence's whole chunks in order with its DK x 32 block of S resident (each warp a 16 x 8 ST
// tiles of it in mma accumulators, and a copy in shared memory as the next chunk's B operand), S read once and
// written once. Columns are independent, so the four blocks of a 128-wide head repeat only the S-free products
// (k k^T, q k^T, the inverses). Per chunk: k and v's 32 columns into shared memory (cp.async), q straight into
// the fragments of the warps that read it; warps 0-3 (K warps) take the k rows of slab w = 16 tokens: k k^T up to
// the diagonal block and k S, giving L and rhs; warps 4-7 (Q warps) the q rows of slab 7 - w (so each SM
// sub-partition gets one light and one heavy slab): q k^T and q S, kept in registers for the output; warps 0-1
// invert the four diagonal blocks; warps 0-3 solve an 8-column tile of u each; the Q warps add (q k^T * D) u to
// their exp(G) q S and write o; every warp updates its tiles of S. The products are mma.sync m16n8k8 TF32 in the
// 3xTF32 split (x = big + small, big = tf32(x), small = tf32(x - big); a b ~ big small + small big + big big, fp32
// accumulators): fp32-level accuracy from tensor cores whose one TF32 product keeps 11 bits.
//
// Shared memory (Shared<DK>): 81 KiB at DK 128, 55 KiB at 64, within every target's per-block limit (sm_86 /
// sm_89 99 KiB, sm_80 163 KiB, sm_90 227 KiB). Rows are padded so the fragment reads hit 32 banks (all but the
// state update's transposed k, two-way): k rows of DK + 4 floats, S and v / u rows of 40, the system's rows of 68.
//
// Reduction order (batch invariance). A chunk's arithmetic depends only on the chunk's q, k, v, g, beta and the
// S before it: every sum has one order fixed by DK (the mma k-steps in increasing order, the three TF32 products
// in a fixed order), nothing depends on the batch or on other sequences, and S passes between chunks as fp32,
// in registers within a step and through memory between steps, the same bits either way. So a prompt's chunks
// give the same output and state bits in one step or split at multiples of 64 (tests/cuda/
// test_delta_rule_chunked_cuda.py). The numbers differ from the recurrent form's within fp32 accuracy
// (tests/cpu/test_delta_rule_chunked.py: a numpy transcription with TF32 rounding against float64).
//
// Resources (ptxas -v, 2026-12-03): sm_90a DK 128 242 registers, DK 64 207; sm_80 239 / 203; sm_89 244 / 206; no
// spill, no stack: the registers hold one block of 256 threads an SM. Speed: not measured; written on 2026-12-03
// without a GPU (the numpy transcription is what has run).
#include "delta_chunks.cuh"
#include "pdl.cuh"
#include "tensor_core.cuh"

namespace drc {
constexpr int CHUNK = dchunk::CHUNK;
constexpr int COLS = 32;        // columns of S a block takes
constexpr int WARPS = 8;        // 4 K warps, 4 Q warps
constexpr int THREADS = 32 * WARPS;
constexpr int SLABS = CHUNK / 16;  // 16-token slabs: the rows of one m16 fragment
constexpr int TILES = COLS / 8;    // n8 tiles of a block's columns
constexpr int PAD_COLS = COLS + 8;  // S and v / u rows: B reads [k = lane % 4][n = lane / 4] on 32 banks
constexpr int PAD_CHUNK = CHUNK + 4;  // the system's rows

template <int DK>
struct Shared {
    float k[CHUNK][DK + 4];       // the chunk's k rows (A and B reads [row = lane / 4][col = lane % 4] on 32 banks)
    float s[DK][PAD_COLS];        // S's column block at the chunk's start
    float u[CHUNK][PAD_COLS];     // v's columns, then rhs, then u
    float l[CHUNK][PAD_CHUNK];    // L below the diagonal blocks, T_r on them
    float eg[CHUNK];              // exp(G_i)
    float eg_rest[CHUNK];         // exp(G_last - G_i)
    float cum[CHUNK];             // G_i
    float beta[CHUNK];
};

// A fragment as two TF32 parts (mma.m16n8k8: A 4 registers, B 2).
template <int N>
struct Split {
    unsigned big[N], small[N];
};

// cvt.rna.tf32.f32 for finite x (the nearest float with 10 mantissa bits, ties away from zero) as an integer add
// and mask: the instruction compiles to those plus a compare and a select (NaN), and with it the chunk loop of
// DK 128 took 10,868 instructions against 8,202 (sm_90a SASS, scripts/kernel_resources.py --sass).
__device__ __forceinline__ unsigned tf32(float x) { return (__float_as_uint(x) + 0x1000u) & 0xffffe000u; }

// x = big + small: big = tf32(x), and x - big (exact in fp32: at most 12 significant bits) rounded again.
template <int N>
__device__ __forceinline__ Split<N> split(const float (&x)[N]) {
    Split<N> s;
#pragma unroll
    for (int i = 0; i < N; ++i) {
        s.big[i] = tf32(x[i]);
        s.small[i] = tf32(__fsub_rn(x[i], __uint_as_float(s.big[i])));
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

// The A fragment of k-step columns 8 t .. 8 t + 7 from accumulator tile t of the same 16 rows (thread (g, c)
// holds columns 2 c, 2 c + 1; the A fragment wants c and c + 4): each from the lane that holds it.
__device__ __forceinline__ Split<4> a_from_acc(const float (&c)[4], int lane) {
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
    return split(x);
}

// Accumulator element e of tile (row r0, column c0) in this lane: its row and column.
__device__ __forceinline__ int acc_row(int r0, int lane, int e) { return r0 + lane / 4 + 8 * (e >> 1); }
__device__ __forceinline__ int acc_col(int c0, int lane, int e) { return c0 + 2 * (lane % 4) + (e & 1); }
}  // namespace drc

template <int DK>
__global__ void __launch_bounds__(drc::THREADS, 1) delta_rule_chunked(
    float* __restrict__ out, const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
    const float* __restrict__ g, const float* __restrict__ beta, float* __restrict__ delta_state,
    const int* __restrict__ starts, const int* __restrict__ positions, const int* __restrict__ slots, float scale,
    int num_slots, int layers, int layer, int key_heads, int v_heads, int dv, int q_stride, int k_stride,
    int v_stride, int tiled) {
    using namespace drc;
    static_assert(DK % 32 == 0 && DK >= 64 && DK <= 128, "S's DK rows: 16 x 8 ST tiles of it a warp");
    constexpr int KST = DK + 4, WARPS_A_SLAB = 128 / DK, ST = TILES / WARPS_A_SLAB;
    extern __shared__ __align__(16) unsigned char smem[];
    Shared<DK>& sm = *reinterpret_cast<Shared<DK>*>(smem);
    pdl_enter();
    const int col_blocks = dv / COLS;
    const int h = blockIdx.x / col_blocks, c0 = blockIdx.x % col_blocks * COLS, seq = blockIdx.y;
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
    const int kh = tiled ? h % key_heads : h / (v_heads / key_heads);
    float* state = delta_state + (((size_t)slot * layers + layer) * v_heads + h) * DK * dv + c0;

    // This warp's tiles of S: rows s_row .. + 15, ST n8 tiles from column s_col.
    const int s_row = warp / WARPS_A_SLAB * 16, s_col = warp % WARPS_A_SLAB * 8 * ST;
    float s_acc[ST][4];
#pragma unroll
    for (int t = 0; t < ST; ++t)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int r = acc_row(s_row, lane, e), c = acc_col(s_col + 8 * t, lane, e);
            s_acc[t][e] = state[(size_t)r * dv + c];
            sm.s[r][c] = s_acc[t][e];
        }

    const bool k_warp = warp < 4;
    const int slab = k_warp ? warp : 7 - warp, row0 = 16 * slab, kk_tiles = 2 * slab + 2;
    for (int t0 = lo + head; t0 < lo + tail; t0 += CHUNK) {
        // The chunk's k rows and v columns into shared memory; the Q warps' q rows into their A fragments.
        for (int e = threadIdx.x; e < CHUNK * DK; e += THREADS)
            tc::cp_async<4>(&sm.k[e / DK][e % DK], k + (size_t)(t0 + e / DK) * k_stride + kh * DK + e % DK);
        for (int e = threadIdx.x; e < CHUNK * COLS; e += THREADS)
            tc::cp_async<4>(&sm.u[e / COLS][e % COLS],
                            v + (size_t)(t0 + e / COLS) * v_stride + (size_t)h * dv + c0 + e % COLS);
        tc::cp_async_commit();
        float qa[DK / 8][4];
        if (!k_warp) {
            const float* p = q + (size_t)(t0 + row0 + lane / 4) * q_stride + kh * DK + lane % 4;
#pragma unroll
            for (int ks = 0; ks < DK / 8; ++ks) {
                qa[ks][0] = __fmul_rn(p[8 * ks], scale);
                qa[ks][1] = __fmul_rn(p[8 * (size_t)q_stride + 8 * ks], scale);
                qa[ks][2] = __fmul_rn(p[8 * ks + 4], scale);
                qa[ks][3] = __fmul_rn(p[8 * (size_t)q_stride + 8 * ks + 4], scale);
            }
        }
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
        }
        tc::cp_async_wait<0>();
        __syncthreads();

        // This warp's slab of k (K warps) or q (Q warps) times k^T (tokens up to its diagonal block) and S.
        float kk[2 * SLABS][4] = {}, ks_acc[TILES][4] = {};
#pragma unroll
        for (int ks = 0; ks < DK / 8; ++ks) {
            const Split<4> a = k_warp ? a_frag<KST>(&sm.k[0][0], row0, 8 * ks, lane) : split(qa[ks]);
#pragma unroll
            for (int t = 0; t < 2 * SLABS; ++t)
                if (t < kk_tiles) mma3(kk[t], a, bt_frag<KST>(&sm.k[0][0], 8 * ks, 8 * t, lane));
#pragma unroll
            for (int t = 0; t < TILES; ++t) mma3(ks_acc[t], a, b_frag<PAD_COLS>(&sm.s[0][0], 8 * ks, 8 * t, lane));
        }

        // K warps: L's rows of the slab and rhs = beta (v - exp(G) k S) over v. Q warps: q k^T * D (lower) and
        // exp(G) q S, in registers. No warp reads what another writes here.
#pragma unroll
        for (int t = 0; t < 2 * SLABS; ++t)
            if (t < kk_tiles)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int i = acc_row(row0, lane, e), j = acc_col(8 * t, lane, e);
                    const bool below = k_warp ? j < i : j <= i;
                    const float x = below ? kk[t][e] * expf(__fsub_rn(sm.cum[i], sm.cum[j])) : 0.0f;
                    if (k_warp)
                        sm.l[i][j] = sm.beta[i] * x;
                    else
                        kk[t][e] = x;
                }
#pragma unroll
        for (int t = 0; t < TILES; ++t)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int i = acc_row(row0, lane, e), c = acc_col(8 * t, lane, e);
                if (k_warp)
                    sm.u[i][c] = sm.beta[i] * (sm.u[i][c] - sm.eg[i] * ks_acc[t][e]);
                else
                    ks_acc[t][e] *= sm.eg[i];
            }
        __syncthreads();

        // The diagonal blocks' inverses T_r = (I + L_rr)^-1, a thread a column: (I + L_rr) x = e_j by forward
        // substitution, then written over L_rr.
        if (warp < 2) {
            const int b = 16 * (2 * warp + lane / 16), j = lane % 16;
            float x[16];
#pragma unroll
            for (int i = 0; i < 16; ++i) {
                float sum = 0.0f;
#pragma unroll
                for (int m = 0; m < i; ++m) sum = fmaf(sm.l[b + i][b + m], x[m], sum);
                x[i] = i < j ? 0.0f : (i == j ? 1.0f : -sum);
            }
            __syncwarp();
#pragma unroll
            for (int i = 0; i < 16; ++i) sm.l[b + i][b + j] = x[i];
        }
        __syncthreads();

        // u by slabs, warp w (< 4) the columns 8 w .. 8 w + 7: u_r = T_r (rhs_r - sum over s < r of L_rs u_s).
        if (k_warp) {
            const int n0 = 8 * warp;
#pragma unroll
            for (int r = 0; r < SLABS; ++r) {
                float w[4];
#pragma unroll
                for (int e = 0; e < 4; ++e) w[e] = sm.u[acc_row(16 * r, lane, e)][acc_col(n0, lane, e)];
#pragma unroll
                for (int ks = 0; ks < 2 * r; ++ks)
                    mma3(w, a_frag<PAD_CHUNK>(&sm.l[0][0], 16 * r, 8 * ks, lane, -1.0f),
                         b_frag<PAD_COLS>(&sm.u[0][0], 8 * ks, n0, lane));
#pragma unroll
                for (int e = 0; e < 4; ++e) sm.u[acc_row(16 * r, lane, e)][acc_col(n0, lane, e)] = w[e];
                __syncwarp();
                float ur[4] = {};
#pragma unroll
                for (int ks = 0; ks < 2; ++ks)
                    mma3(ur, a_frag<PAD_CHUNK>(&sm.l[0][0], 16 * r, 16 * r + 8 * ks, lane),
                         b_frag<PAD_COLS>(&sm.u[0][0], 16 * r + 8 * ks, n0, lane));
                __syncwarp();
#pragma unroll
                for (int e = 0; e < 4; ++e) sm.u[acc_row(16 * r, lane, e)][acc_col(n0, lane, e)] = ur[e];
                __syncwarp();
            }
        }
        __syncthreads();

        // Q warps: o = exp(G) q S + (q k^T * D) u over the tokens up to the slab's end.
        if (!k_warp) {
#pragma unroll
            for (int ks = 0; ks < 2 * SLABS; ++ks)
                if (ks < kk_tiles) {
                    const Split<4> a = a_from_acc(kk[ks], lane);
#pragma unroll
                    for (int t = 0; t < TILES; ++t)
                        mma3(ks_acc[t], a, b_frag<PAD_COLS>(&sm.u[0][0], 8 * ks, 8 * t, lane));
                }
#pragma unroll
            for (int t = 0; t < TILES; ++t)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    o[(size_t)(t0 + acc_row(row0, lane, e)) * out_row + acc_col(8 * t, lane, e)] = ks_acc[t][e];
        }

        // Every warp: its tiles of S <- exp(G_last) S + (exp(G_last - G) k)^T u, then their copy for the next chunk.
        const float eg_last = sm.eg[CHUNK - 1];
#pragma unroll
        for (int t = 0; t < ST; ++t)
#pragma unroll
            for (int e = 0; e < 4; ++e) s_acc[t][e] *= eg_last;
#pragma unroll
        for (int ks = 0; ks < CHUNK / 8; ++ks) {
            const int j = 8 * ks + lane % 4, c = s_row + lane / 4;
            const float x[4] = {sm.k[j][c] * sm.eg_rest[j], sm.k[j][c + 8] * sm.eg_rest[j],
                                sm.k[j + 4][c] * sm.eg_rest[j + 4], sm.k[j + 4][c + 8] * sm.eg_rest[j + 4]};
            const Split<4> a = split(x);
#pragma unroll
            for (int t = 0; t < ST; ++t) mma3(s_acc[t], a, b_frag<PAD_COLS>(&sm.u[0][0], 8 * ks, s_col + 8 * t, lane));
        }
#pragma unroll
        for (int t = 0; t < ST; ++t)
#pragma unroll
            for (int e = 0; e < 4; ++e) sm.s[acc_row(s_row, lane, e)][acc_col(s_col + 8 * t, lane, e)] = s_acc[t][e];
        __syncthreads();  // the next chunk overwrites k and u, and reads S
    }
#pragma unroll
    for (int t = 0; t < ST; ++t)
#pragma unroll
        for (int e = 0; e < 4; ++e)
            state[(size_t)acc_row(s_row, lane, e) * dv + acc_col(s_col + 8 * t, lane, e)] = s_acc[t][e];
}
