// The Gated DeltaNet layer's kernels (Qwen3.5, Qwen3-Next): the delta rule's inputs (the causal conv1d over
// q | k | v, the per-head L2 norm of q and k, the decay and write gates: one kernel), the gated delta rule token by
// token (the recurrent form), the gated output norm, the sigmoid output gate, and zeroing a fresh sequence's state.
// Each is the numpy op of backends/cpu/ops.py (CpuOps.delta_net_inputs, gated_delta_rule, gated_rms_norm,
// sigmoid_gate, reset_fresh_states) on the device.
//
// Layouts. Activations are float32 rows of tokens; an input may be a column range of a wider row (the conv
// output [n, C] holds q | k | v), read in place: its pointer is the range's first element and `*_stride` the
// distance between its rows in elements. The recurrent state mirrors CpuHybridCache: conv [slots, recurrent
// layers, C, K - 1] (each channel's last K - 1 inputs, oldest first) and delta [slots, recurrent layers, value
// heads, d_k, d_v] (the delta rule's S). A step's sequences are given by starts int32 [seqs + 1] (sequence s owns
// tokens starts[s] .. starts[s + 1]) and slots int32 [seqs] (its state slot); `layer` is the recurrent layer's
// index. A sequence whose slot is outside [0, num_slots) gets NaN outputs and its state is not touched. Where
// out may be x (the gated norm, the sigmoid gate), the two pointers are not __restrict__: each element is read
// before its thread writes it, and the compiler must not assume otherwise.
//
// Numerics. fp32, no fast math; where numpy rounds each product and sum separately (it never fuses), the kernels
// do too (__fmul_rn, __fadd_rn, __fdiv_rn, __fsqrt_rn), so elementwise results differ from numpy's only where
// expf / log1pf do (an ulp or two). Row sums (the norms, the delta rule's dot products) run in their own fixed
// order, which numpy's (pairwise, BLAS) is not: a few ulp of the row's magnitude.
//
// Reduction order (batch invariance). Nothing reduces across tokens or sequences. A row's sum of squares: each
// lane of the row's warp adds its elements lane, lane + 32, ... in increasing order, then an xor butterfly; fixed
// by the row length. The delta rule: four neighbouring lanes own one column of S for one (sequence, value head),
// each a fixed quarter of its rows, and sum a dot product as four fmaf chains over their rows in order, then
// (a0 + a1) + (a2 + a3); the state is read from memory at the step's start and written at its end, so a token's
// output and the state after it are the same bits whether its prompt ran in one step or in several, and whatever
// else shares the step.
//
// Speed (H200, 2026-12-03, d9eb142, a qwen3.5-35b-a3b decode step of one token, in-graph events included):
// delta_net_inputs 6.0 us a layer (the three launches it replaced 13.5), gated_delta_rule 6.7, gated_rms_norm 6.0.
// Their tests (tests/cuda/test_delta_net_cuda.py, test_delta_rule_chunked_cuda.py) pass there.
#include "delta_chunks.cuh"
#include "pdl.cuh"

namespace dn {
constexpr int ROW_WARPS = 8;  // warp-per-row kernels: rows a block of 256
constexpr int CONV_TOKENS = 16;  // delta_net_inputs: tokens a thread walks (a chunk: grid z)
constexpr int CONV_CHANNELS = 128;  // delta_net_inputs: channels a block takes (whole heads of q and k)
constexpr int RULE_TILE = 8;   // gated_delta_rule: tokens whose q, k, v, decay and beta a block stages at a time
constexpr int RULE_PARTS = 4;  // gated_delta_rule: threads sharing a column of S (neighbouring lanes)
constexpr int MAX_DV = 128;    // gated_delta_rule: columns of S (RULE_PARTS threads each)

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

// sum(row[i]^2) by one warp, each square rounded then added (numpy's np.sum(np.square(x))): lane l adds its
// elements l, l + 32, ... in order, then the butterfly. Every lane gets the total.
__device__ __forceinline__ float row_sum_squares(const float* row, int dim, int lane) {
    float ss = 0.0f;
    for (int i = lane; i < dim; i += 32) ss = __fadd_rn(ss, __fmul_rn(row[i], row[i]));
    return warp_sum(ss);
}

// numpy's x / (1 + exp(-x)).
__device__ __forceinline__ float silu(float x) { return __fdiv_rn(x, __fadd_rn(1.0f, expf(-x))); }

// numpy's 1 / (1 + exp(-x)).
__device__ __forceinline__ float sigmoid(float x) { return __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-x))); }

// The sum of the RULE_PARTS neighbouring lanes' x, as (x0 + x1) + (x2 + x3), in each of them.
__device__ __forceinline__ float parts_sum(float x) {
    x = __fadd_rn(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return __fadd_rn(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

__device__ __forceinline__ bool bad_slot(int slot, int num_slots) { return slot < 0 || slot >= num_slots; }

// delta_net_inputs' gates of tokens [t0, t1), the block's threads striding over (token, value head).
__device__ __forceinline__ void gates(float* __restrict__ g, float* __restrict__ beta_out,
                                      const float* __restrict__ alpha, const float* __restrict__ beta,
                                      const float* __restrict__ dt_bias, const float* __restrict__ a, int t0, int t1,
                                      int heads, int alpha_stride, int beta_stride, int group, int group_stride) {
    for (int i = threadIdx.x; i < (t1 - t0) * heads; i += blockDim.x) {
        const int t = t0 + i / heads, h = i % heads;
        const int col = (h / group) * group_stride + h % group;
        const float z = __fadd_rn(alpha[(size_t)t * alpha_stride + col], dt_bias[h]);
        const float softplus = __fadd_rn(fmaxf(z, 0.0f), log1pf(expf(-fabsf(z))));
        g[(size_t)t * heads + h] = __fmul_rn(a[h], softplus);
        beta_out[(size_t)t * heads + h] = sigmoid(beta[(size_t)t * beta_stride + col]);
    }
}
}  // namespace dn

// delta_net_inputs. Everything the delta rule reads but its state, in one launch: x = q | k | v [n, C] -> out
// [n, C] (never x: blocks read inputs other blocks' tokens overwrite) and g, beta_out [n, heads].
//   The conv1d: per sequence and channel c, SiLU(sum over taps j of weight[c, j] in_{t - (K - 1) + j}), where
// in_{-K+1} .. in_{-1} are the slot's conv state; the state is then replaced by the sequence's last K - 1 inputs.
// Sum order as numpy's: w0 in0, then + w_j in_j for j = 1 .. K - 1, each product and sum rounded.
//   The L2 norm: the first `normed` channels (q and k), per head of d_k, divided by sqrt(sum of squares + eps).
//   The gates: g = a[h] * softplus(alpha + dt_bias[h]) (numpy's np.logaddexp(0, x) = max(x, 0) + log1p(exp(-|x|))),
// beta_out = sigmoid(beta); value head h reads column (h / group) * group_stride + h % group of its rows (group =
// heads: the plain [n, heads]; Qwen3-Next's fused projection holds per key head its betas, then its alphas).
//   grid (ceil(C / CONV_CHANNELS) + 1, seqs, chunks of CONV_TOKENS tokens). A block of x below the last takes
// CONV_CHANNELS channels of one sequence's chunk, a thread a channel walking the chunk's tokens with the last K - 1
// inputs in registers, its window starting from x (or the state, before the sequence's first token). Only the first
// chunk reads the state (CONV_TOKENS >= K - 1), so it alone writes the new one: no block reads what another writes.
// d_k divides CONV_CHANNELS, so a block holds whole heads: its q and k outputs wait in shared memory for the block's
// barrier, then each warp takes (token, head) rows in turn, lane l adding the squares of the row's elements l,
// l + 32, ... in order, then the xor butterfly. The last block of x computes the gates of its chunk's tokens, a
// thread an element. A token's numbers are the same expressions at any chunking and batch. A sequence whose slot
// is bad gets NaN in out (its gates are still computed: they need no state).
//   It replaced three kernels (causal_conv1d, l2_norm, delta_net_gates), whose bits it keeps (a GPU test at e75c158
// compares them), and which took 5.0 + 4.2 + 4.3 us in each of the 30 delta-net layers of Qwen3.5-35B-A3B's batch-1
// decode step on the H200. ptxas (sm_90a, K = 4): 40 registers, 8 KiB shared memory, no spill.
template <int K>
__global__ void __launch_bounds__(dn::CONV_CHANNELS) delta_net_inputs(
    float* __restrict__ out, float* __restrict__ g, float* __restrict__ beta_out, const float* __restrict__ x,
    const float* __restrict__ weight, float* __restrict__ conv, const float* __restrict__ alpha,
    const float* __restrict__ beta, const float* __restrict__ dt_bias, const float* __restrict__ a,
    const int* __restrict__ starts, const int* __restrict__ slots, int num_slots, int layers, int layer,
    int channels, int normed, int d_k, float eps, int heads, int alpha_stride, int beta_stride, int group,
    int group_stride) {
    static_assert(K >= 2 && dn::CONV_TOKENS >= K - 1, "the state holds K - 1 inputs, all before the first chunk");
    __shared__ float qk_s[dn::CONV_TOKENS][dn::CONV_CHANNELS];  // the chunk's SiLU outputs of q and k channels
    const bool gate_block = blockIdx.x == gridDim.x - 1;
    const int tid = threadIdx.x, c0 = blockIdx.x * dn::CONV_CHANNELS, c = c0 + tid;
    const bool live = !gate_block && c < channels;
    float w[K];
    // The taps are weights (no kernel writes them): loaded before waiting on the previous kernel.
#pragma unroll
    for (int j = 0; j < K; ++j) w[j] = live ? __ldg(weight + (size_t)c * K + j) : 0.0f;
    pdl_enter();
    const int seq = blockIdx.y, lo = starts[seq], hi = starts[seq + 1], slot = slots[seq];
    const int t0 = lo + blockIdx.z * dn::CONV_TOKENS, t1 = min(t0 + dn::CONV_TOKENS, hi);
    if (t0 >= hi) return;
    if (gate_block) {
        dn::gates(g, beta_out, alpha, beta, dt_bias, a, t0, t1, heads, alpha_stride, beta_stride, group,
                  group_stride);
        return;
    }
    if (dn::bad_slot(slot, num_slots)) {
        for (int t = t0; live && t < t1; ++t) out[(size_t)t * channels + c] = __int_as_float(0x7fc00000);
        return;
    }
    if (live) {
        float* state = conv + (((size_t)slot * layers + layer) * channels + c) * (K - 1);
        float window[K - 1];  // the K - 1 inputs before token t, oldest first (before lo: the state, first chunk)
#pragma unroll
        for (int j = 0; j < K - 1; ++j) {
            const int p = t0 - (K - 1) + j;
            window[j] = p >= lo ? x[(size_t)p * channels + c] : state[j];
        }
        for (int t = t0; t < t1; ++t) {
            const float in = x[(size_t)t * channels + c];
            float acc = __fmul_rn(w[0], window[0]);
#pragma unroll
            for (int j = 1; j < K - 1; ++j) acc = __fadd_rn(acc, __fmul_rn(w[j], window[j]));
            acc = __fadd_rn(acc, __fmul_rn(w[K - 1], in));
#pragma unroll
            for (int j = 0; j < K - 2; ++j) window[j] = window[j + 1];
            window[K - 2] = in;
            if (c < normed)
                qk_s[t - t0][tid] = dn::silu(acc);
            else
                out[(size_t)t * channels + c] = dn::silu(acc);
        }
        // The sequence's last K - 1 inputs: the window, where this chunk is its last; else all of x (it is longer
        // than CONV_TOKENS >= K - 1 tokens).
        if (blockIdx.z == 0) {
#pragma unroll
            for (int j = 0; j < K - 1; ++j)
                state[j] = t1 == hi ? window[j] : x[(size_t)(hi - (K - 1) + j) * channels + c];
        }
    }
    if (c0 >= normed) return;  // the whole block: v channels only
    __syncthreads();
    const int lane = tid % 32, per_token = min(dn::CONV_CHANNELS, normed - c0) / d_k;
    for (int r = tid / 32; r < (t1 - t0) * per_token; r += dn::CONV_CHANNELS / 32) {
        const int tt = r / per_token, col = r % per_token * d_k;
        const float* row = qk_s[tt] + col;
        const float norm = __fsqrt_rn(__fadd_rn(dn::row_sum_squares(row, d_k, lane), eps));
        float* o = out + (size_t)(t0 + tt) * channels + c0 + col;
        for (int i = lane; i < d_k; i += 32) o[i] = __fdiv_rn(row[i], norm);
    }
}

// gated_delta_rule. q, k [n, key heads x DK] (rows q_stride, k_stride apart), v [n, value heads x dv] (rows
// v_stride apart), g, beta [n, value heads] -> out [n, value heads, dv]; the slot's S [value heads, DK, dv] is
// updated in place. Value head h reads key head h % key_heads (tiled: Qwen3.5 files, whose converter reorders the
// value heads) or h / (value heads / key heads) (grouped: Qwen3-Next). Per token, as delta_rule_recurrent:
//   S <- S exp(g); delta = beta (v - S^T k); S <- S + k delta^T; o = S^T (scale q)
// with numpy's roundings on the elementwise steps (scale q, S exp(g), v - S^T k, times beta, k delta^T, the add).
// grid (value heads x dv / cols, seqs), a block of RULE_PARTS x cols threads (cols a multiple of 32 dividing dv,
// <= MAX_DV) taking columns [c0, c0 + cols) of S: thread (j, p) = (j - c0) RULE_PARTS + p holds S[i, j] for i = p,
// p + RULE_PARTS, ... (DK / RULE_PARTS floats) in registers for the whole step, so S is read once and written
// once. Columns are independent (each has its own delta and output), so how many a block takes moves work, not
// bits: 32 puts a decode token's 32 heads of 128 on 128 blocks, where a block a head left 100 of the H200's 132
// SMs idle. A column's dot products: part p's fmaf chain over its i in order, then
// the xor butterfly over the four parts of the warp, (a0 + a1) + (a2 + a3), the same bits in all four (float
// addition commutes). A whole column a thread took 216 registers at DK = 64 and spilled at 128 (S and the staged k
// held in registers); four parts take 128 at 128 (ptxas, sm_90a; 96 before the part argument of 8e38707). RULE_TILE tokens' q, k, v, decay and beta are
// staged in shared memory at a time. `part` (dchunk::Part) picks a sequence's tokens: all of them, or only those
// before its first whole 64-position chunk (HEAD) or after its last (TAIL), by positions[] (delta_chunks.cuh;
// delta_rule_chunked.cu takes the chunks between); it only moves the range, each token's arithmetic is the same.
template <int DK>
__global__ void __launch_bounds__(dn::RULE_PARTS * dn::MAX_DV) gated_delta_rule(
    float* __restrict__ out, const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
    const float* __restrict__ g, const float* __restrict__ beta, float* __restrict__ delta_state,
    const int* __restrict__ starts, const int* __restrict__ slots, float scale, int num_slots, int layers, int layer,
    int key_heads, int v_heads, int dv, int q_stride, int k_stride, int v_stride, int tiled,
    const int* __restrict__ positions, int part) {
    constexpr int PARTS = dn::RULE_PARTS, OWN = DK / PARTS;
    static_assert(DK % PARTS == 0, "a part owns every PARTS-th row of S");
    __shared__ float q_s[dn::RULE_TILE][DK], k_s[dn::RULE_TILE][DK], v_s[dn::RULE_TILE][dn::MAX_DV];
    __shared__ float decay_s[dn::RULE_TILE], beta_s[dn::RULE_TILE];
    pdl_enter();
    const int threads = blockDim.x, cols = threads / PARTS, col_blocks = dv / cols;
    const int h = blockIdx.x / col_blocks, c0 = blockIdx.x % col_blocks * cols, seq = blockIdx.y;
    const int tid = threadIdx.x, j = c0 + tid / PARTS, p = tid % PARTS;
    const int slot = slots[seq];
    int lo = starts[seq], hi = starts[seq + 1];
    if (part != dchunk::ALL && hi > lo) {
        int head, tail;
        dchunk::whole_chunks(positions[lo], hi - lo, head, tail);
        if (part == dchunk::HEAD)
            hi = lo + head;
        else
            lo += tail;
    }
    const int kh = tiled ? h % key_heads : h / (v_heads / key_heads);
    float* o = out + (size_t)h * dv + j;
    const size_t out_row = (size_t)v_heads * dv;
    if (dn::bad_slot(slot, num_slots)) {
        if (p == 0)
            for (int t = lo; t < hi; ++t) o[t * out_row] = __int_as_float(0x7fc00000);
        return;
    }
    float* state = delta_state + (((size_t)slot * layers + layer) * v_heads + h) * DK * dv + (size_t)p * dv + j;
    float s[OWN];  // S[p + PARTS m, j]
#pragma unroll
    for (int m = 0; m < OWN; ++m) s[m] = state[(size_t)m * PARTS * dv];
    for (int t0 = lo; t0 < hi; t0 += dn::RULE_TILE) {
        const int count = min(dn::RULE_TILE, hi - t0);
        for (int e = tid; e < count * DK; e += threads) {
            const size_t t = t0 + e / DK;
            const int i = e % DK;
            q_s[e / DK][i] = __fmul_rn(q[t * q_stride + kh * DK + i], scale);
            k_s[e / DK][i] = k[t * k_stride + kh * DK + i];
        }
        for (int e = tid; e < count * cols; e += threads)
            v_s[e / cols][e % cols] = v[(size_t)(t0 + e / cols) * v_stride + (size_t)h * dv + c0 + e % cols];
        if (tid < count) {
            decay_s[tid] = expf(g[(size_t)(t0 + tid) * v_heads + h]);
            beta_s[tid] = beta[(size_t)(t0 + tid) * v_heads + h];
        }
        __syncthreads();
        for (int tt = 0; tt < count; ++tt) {
            const float decay = decay_s[tt];
            const float* kt = k_s[tt] + p;
            float predicted = 0.0f;  // part p's share of (S^T k)_j
#pragma unroll
            for (int m = 0; m < OWN; ++m) {
                s[m] = __fmul_rn(s[m], decay);
                predicted = fmaf(kt[m * PARTS], s[m], predicted);
            }
            const float delta = __fmul_rn(__fsub_rn(v_s[tt][j - c0], dn::parts_sum(predicted)), beta_s[tt]);
            const float* qt = q_s[tt] + p;
            float acc = 0.0f;  // part p's share of (S^T q)_j
#pragma unroll
            for (int m = 0; m < OWN; ++m) {
                s[m] = __fadd_rn(s[m], __fmul_rn(kt[m * PARTS], delta));
                acc = fmaf(qt[m * PARTS], s[m], acc);
            }
            acc = dn::parts_sum(acc);
            if (p == 0) o[(t0 + tt) * out_row] = acc;
        }
        __syncthreads();  // the next tile overwrites what this one read
    }
#pragma unroll
    for (int m = 0; m < OWN; ++m) state[(size_t)m * PARTS * dv] = s[m];
}

// gated_rms_norm. x [n, heads, dim] (contiguous), gate [n, heads x dim] (rows gate_stride apart), weight [dim] ->
// out [n, heads, dim] (out may be x): (x / sqrt(mean(x^2) + eps)) * weight * silu(gate), each step rounded as
// numpy's CpuOps.gated_rms_norm. A warp a (token, head) row, 8 rows a block of 256.
extern "C" __global__ void __launch_bounds__(256) gated_rms_norm(float* out, const float* x,
                                                                const float* __restrict__ weight,
                                                                const float* __restrict__ gate, int n, int heads,
                                                                int dim, int gate_stride, float eps) {
    pdl_enter();
    const int lane = threadIdx.x % 32;
    const long long row = (long long)blockIdx.x * dn::ROW_WARPS + threadIdx.x / 32;
    if (row >= (long long)n * heads) return;
    const int t = (int)(row / heads), h = (int)(row % heads);
    const float* xr = x + (size_t)row * dim;
    const float* gr = gate + (size_t)t * gate_stride + (size_t)h * dim;
    float* o = out + (size_t)row * dim;
    const float variance = __fdiv_rn(dn::row_sum_squares(xr, dim, lane), (float)dim);
    const float rms = __fsqrt_rn(__fadd_rn(variance, eps));
    for (int i = lane; i < dim; i += 32) o[i] = __fmul_rn(__fmul_rn(__fdiv_rn(xr[i], rms), weight[i]), dn::silu(gr[i]));
}

// sigmoid_gate. x [rows, cols] (contiguous) -> out (may be x) = x / (1 + exp(-gate)) (numpy's x * sigmoid(gate)),
// gate element (r, c) at gate[r * gate_stride + c], or gate[r * gate_stride] for every c where broadcast (one
// column gates a whole row: the shared expert's); plus addend[i] where addend is given (the routed experts' sum
// the gated shared expert is added to, numpy's routed + gated). A thread an element.
extern "C" __global__ void __launch_bounds__(256) sigmoid_gate(float* out, const float* x,
                                                              const float* __restrict__ gate, const float* addend,
                                                              long long count, int cols, int gate_stride,
                                                              int broadcast) {
    pdl_enter();
    const long long i = (long long)blockIdx.x * 256 + threadIdx.x;
    if (i >= count) return;
    const long long r = i / cols;
    const int c = (int)(i % cols);
    const float z = gate[r * gate_stride + (broadcast ? 0 : c)];
    const float gated = __fdiv_rn(x[i], __fadd_rn(1.0f, expf(-z)));
    out[i] = addend != nullptr ? __fadd_rn(addend[i], gated) : gated;
}

// reset_states. Zeroes the conv and delta state of every layer of slots[y] (conv_size and delta_size floats a
// slot); a negative slot is skipped. grid (blocks, count), each block's threads striding over the slot's floats.
extern "C" __global__ void __launch_bounds__(256) reset_states(float* __restrict__ conv, float* __restrict__ delta,
                                                              const int* __restrict__ slots, int num_slots,
                                                              long long conv_size, long long delta_size) {
    pdl_enter();
    const int slot = slots[blockIdx.y];
    if (dn::bad_slot(slot, num_slots)) return;
    const long long step = (long long)gridDim.x * 256;
    for (long long i = (long long)blockIdx.x * 256 + threadIdx.x; i < conv_size; i += step)
        conv[slot * conv_size + i] = 0.0f;
    for (long long i = (long long)blockIdx.x * 256 + threadIdx.x; i < delta_size; i += step)
        delta[slot * delta_size + i] = 0.0f;
}
