// Paged causal grouped-query attention over an fp16 KV cache: a tile-split decode kernel, a tensor-core
// flash kernel for prefill chunks, and the pass that folds decode tile partials.
//
// Layouts (per layer):
//   q            float32 [num_tokens, num_heads, HD]     sequences back to back (query_starts)
//   out          float32 [num_tokens, num_heads, HD]
//   k/v_cache    fp16    [num_blocks, block_size, num_kv_heads, HD]   any block_size (16, 32 ...)
//   block_tables int32   [num_seqs, max_blocks]          physical block of each logical block
//   context_lens int32   [num_seqs]   tokens in the cache, this step's new ones included
//   query_starts int32   [num_seqs + 1]
//   part_out     float32 [num_seqs, num_heads, part_tiles, HD]   decode tile partials (unnormalised O_t)
//   part_ml      float2  [num_seqs, num_heads, part_tiles]       their (m_t, l_t)
// Query token j of a sequence with q_len new tokens sits at position ctx - q_len + j and sees cache
// positions 0..that position. Query head h reads kv head h / (num_heads / num_kv_heads).
//
// The definition (batch invariance rule 3, docs/kernels.md): a query row's output over its keys [0, p] is a left
// fold, in position order, of per-tile partials over the 64-key tiles [64 t, 64 t + 64) anchored at position 0.
//   partial of tile t: s = the row's scores (q scaled by scale * log2(e) and rounded to fp16, times K on the
//     tensor cores; keys past p score -inf); m_t = max s; P = exp2f(s - m_t) (0 for masked keys); l_t = the sum of
//     P (each lane its 16 keys in order, then the quad's xor butterfly 1, 2, every tile); O_t = P, rounded to fp16,
//     times V by mma.sync.m16n8k16 from a zero accumulator, the tile's four 16-key chunks in order.
//     A tile in which the row sees no key (prefill, past its position) is skipped: m_t = -inf folds as the
//     identity (b = 0, a = 1), its P and l_t being 0 without forming exp2(-inf - -inf).
//   fold(state (m, l, O), tile): fold_scales gives M = max(m, m_t), a = 2^(m - M), b = 2^(m_t - M) (one exp2f,
//     the other 1); l = fma(l_t, b, l * a), O = fma(O_t, b, O * a), each an explicit _rn intrinsic. The first tile
//     folded into the empty state (-inf, 0, 0) gives exactly (m_t, l_t, O_t).
//   out = O * rcp(l) (__frcp_rn, __fmul_rn), then the activation-format write where asked.
// Every kernel computes exactly this, so a query's bits are the same decoded or inside any prefill chunk, alone
// or in any batch, however its tiles are spread over CTAs. Grid sizes (max_query_len, max_context_len) only add
// CTAs that exit at once.
//
// Both attention kernels share one body (attention_tile). A CTA holds ROWS "rows" of one sequence and one kv
// head: row r is query token r / group, head r % group of the kv group, so a GQA group's K/V is read once.
// Q is kept in registers as mma A fragments. K/V come in 64-key tiles from the paged blocks into shared memory
// (cp.async, two stages, or one where two do not fit the GPU; keys past the range are zero-filled, never read).
//   attention_prefill: 4 warps x 16 rows, each warp sees every key; every tile up to the CTA's last row folded in
//                      registers, O_t formed a 16-column slice at a time (8 transient floats) and folded at once.
//                      Sequences with q_len >= 2 only. At HD 256 two such groups of 4 warps split O's head dim
//                      (each computes S over the whole tile, as the decode kernel's warps do): one warp's 16 rows of
//                      all 256 columns (128 O floats and 64 Q fragment registers a thread) would spill.
//   attention_decode:  1 row tile of 16 rows (the group's heads; more tiles on blockIdx.z when group > 16)
//                      x 4 warps that split the head dim: each computes S over every key of the tile
//                      (the same S, max and sum in all four) and O for its quarter of the columns, so
//                      nothing is merged across warps. With the keys split 16 apiece and the warps'
//                      shares merged through shared memory, llama-3.1-8b's batch-1 step on the H200 took
//                      51 us longer, and 32-sequence steps 3.4-3.5% longer (docs/performance.md): the merge
//                      and its barriers cost more than S computed four times. Sequences with q_len == 1
//                      only. CTA (x, kv head, sequence) computes tiles x, x + gridDim.x, ... (the next one's
//                      K/V in flight while it computes one) and writes each as a partial; the launcher picks
//                      gridDim.x from the batch (attention.decode_splits: as many CTAs as fit in one wave, one
//                      CTA per sequence and kv head where those alone fill half of it). Where one CTA takes all
//                      of a sequence's tiles (gridDim.x 1, a context of one tile, or more tiles than part_tiles)
//                      it folds them in registers and writes the output itself.
//   attention_merge_splits: for decode sequences whose tiles were split, the fold of their partials in tile order.
// xq / xs (decode only, every token a decode token): out is also written in the mat-vec's activation format
// (act_quant.cuh), as rows of num_heads * HD, by whichever kernel writes the token's out (the decode kernel
// where it folds, else the merge), so the output projection's mat-vec needs no quantizing kernel of its own.
// A mixed batch launches both attention kernels; each skips the sequences the other one owns.
//
// Numerics: q and the probabilities are rounded to fp16 for the tensor cores (relative 2^-11 each); K/V
// are fp16 already. Scores, maxima, sums and outputs are fp32.
//
// Measured on the H200: docs/performance.md (the decode kernel and its merge in the per-op profile), before the
// fold (a CTA's running max rescaling O every tile, decode splits merged by log-sum-exp); the fold is not yet
// measured.

#include <cuda_fp16.h>

#include "act_quant.cuh"
#include "pdl.cuh"
#include "trace.cuh"
#include "tensor_core.cuh"

// A named namespace and inline constants: NVRTC names a symbol of internal linkage (an anonymous namespace's, a
// namespace-scope const's that the code takes by reference) with a random id per compile, so the cubin would differ
// from one compile to the next (scripts/compile_time.py compares them).
namespace attn {

inline constexpr int BLOCK_N = 64;      // keys per tile: the unit of the fold, anchored at position 0
inline constexpr int MERGE_ROUND = 32;  // tile partials the merge loads at once before folding them

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

__device__ __forceinline__ int num_key_tiles(int ctx) { return (ctx + BLOCK_N - 1) / BLOCK_N; }

// The fold's scales for a row whose state has max m taking a tile partial of max m_t (M = max(m, m_t)):
// a = 2^(m - M), b = 2^(m_t - M), one of them exactly 1. An empty state (m = -inf) gives a = 0, b = 1; a tile the row
// does not see (m_t = -inf, only ever into a non-empty state) a = 1, b = 0, which leaves the state's bits unchanged.
__device__ __forceinline__ void fold_scales(float& m, float m_t, float& a, float& b) {
  const bool up = m_t > m;
  const float e = exp2f(up ? __fsub_rn(m, m_t) : __fsub_rn(m_t, m));
  a = up ? e : 1.f;
  b = up ? 1.f : e;
  m = up ? m_t : m;
}

// One element of the fold, l or O: x a + x_t b, the same expression in every kernel. The first tile folded into the
// empty state (x = 0, a = 0, b = 1) gives x_t exactly.
__device__ __forceinline__ float fold(float x, float a, float x_t, float b) { return __fmaf_rn(x_t, b, __fmul_rn(x, a)); }

// A row's output from its folded state: one expression everywhere.
__device__ __forceinline__ float finish(float o, float inv_l) { return __fmul_rn(o, inv_l); }

using tc::cp_async_16;
using tc::cp_async_commit;
using tc::cp_async_wait;
using tc::ldmatrix_x4;
using tc::ldmatrix_x4_trans;
using tc::mma_16816;
using tc::smem_addr;

// Two floats as an fp16 pair, lo in the low 16 bits (the element with the lower column index).
__device__ __forceinline__ unsigned pack_half2(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<unsigned*>(&h);
}

// Shared memory the attention kernels ask for: K and V tiles, STAGES deep, rows padded by 16 bytes so that
// ldmatrix's eight row addresses fall in distinct banks. The launcher computes the same number. Two stages
// (cp.async double buffering) where they fit the GPU's shared memory, else one (HD 256 where a block opts in to
// less than its 132 KiB: sm_86, sm_89, sm_120); the stages only change when a tile loads, never the arithmetic.
template <int HD, int STAGES>
constexpr int tile_smem_bytes() {
  return STAGES * 2 * BLOCK_N * (HD + 8) * 2;
}

// out[token, head, d] = v, and with xq its group of 32 in the activation format: the 32 lanes of a warp call
// together, for the 32 d of one group of one (token, head).
template <int HD>
__device__ __forceinline__ void store_out(float* __restrict__ out, int8_t* __restrict__ xq, ActScale* __restrict__ xs,
                                          int num_tokens, int num_heads, int token, int head, int d, float v) {
  const int cols = num_heads * HD, col = head * HD + d;
  out[(size_t)token * cols + col] = v;
  if (xq != nullptr) {
    const float vs[1] = {v};
    aq::quantize_store<1>(vs, true, xq, xs, num_tokens, cols, token, col);
  }
}

// One CTA: ROWS = 16 * WARPS_M rows (query token, head-in-group pairs) of one sequence and kv head, over its key
// tiles (prefill: all up to its last row's position; decode: its share of the sequence's). WARPS_N warps split the head dim of O between them (decode; prefill at HD 256), else 1.
template <int HD, int WARPS_M, int WARPS_N, bool DECODE, int STAGES>
__device__ __forceinline__ void attention_tile(
    float* __restrict__ out, const float* __restrict__ q, const __half* __restrict__ k_cache,
    const __half* __restrict__ v_cache, const int* __restrict__ block_tables, const int* __restrict__ context_lens,
    const int* __restrict__ query_starts, float* __restrict__ part_out, float2* __restrict__ part_ml, int num_heads,
    int num_kv_heads, int block_size, int max_blocks, int max_tiles, int part_tiles, float scale_log2,
    int8_t* __restrict__ xq, ActScale* __restrict__ xs, int num_tokens) {
  constexpr int NT = 32 * WARPS_M * WARPS_N;
  constexpr int ROWS = 16 * WARPS_M;
  constexpr int SK = HD + 8;             // shared row stride in halves
  constexpr int KC = HD / 16;            // k-chunks of the head dim (S = Q K^T)
  constexpr int DTW = HD / 8 / WARPS_N;  // 8-wide tiles of O one warp accumulates
  constexpr int NS = BLOCK_N / 8;        // 8-key tiles of S (every warp: the whole tile)
  static_assert(HD % 16 == 0 && DTW % 2 == 0, "tile shapes");
  static_assert(ROWS * HD * 4 <= tile_smem_bytes<HD, STAGES>(), "a decode CTA's output fits");

  extern __shared__ __align__(16) unsigned char smem[];
  __half* ks = reinterpret_cast<__half*>(smem);  // [STAGES][BLOCK_N][SK]
  __half* vs = ks + STAGES * BLOCK_N * SK;        // [STAGES][BLOCK_N][SK]

  TRACE_BEGIN();
  const int group = num_heads / num_kv_heads;
  const int kvh = blockIdx.y;
  int seq, row_tile;
  if (DECODE) {
    const int row_tiles = (group + ROWS - 1) / ROWS;
    seq = blockIdx.z / row_tiles;
    row_tile = blockIdx.z % row_tiles;
  } else {
    seq = blockIdx.z;
    row_tile = blockIdx.x;
  }
  // The decode kernel runs up to its first K/V loads before waiting on the previous kernel (pdl.cuh): the batch
  // metadata was uploaded before the step, and the cache positions before this step's own token were written by
  // earlier steps. Every CTA waits before it exits, so completion stays transitive down the stream.
  const int q_start = query_starts[seq];
  const int q_len = query_starts[seq + 1] - q_start;
  const int ctx = context_lens[seq];
  if (DECODE ? q_len != 1 : q_len < 2) {  // the other kernel owns this sequence
    if (DECODE) pdl_enter();
    return;
  }
  const int num_rows = q_len * group;
  const int row_base = row_tile * ROWS;
  if (row_base >= num_rows) {
    if (DECODE) pdl_enter();
    return;
  }

  // Prefill: the CTA's last row bounds the keys it needs; its first row bounds the tiles that need no mask.
  const int prefill_end = ctx - q_len + (min(row_base + ROWS, num_rows) - 1) / group + 1;
  const int first_qpos = ctx - q_len + row_base / group;
  // Decode: a sequence's T tiles go to this launch's gridDim.x CTAs, CTA x taking tiles x, x + gridDim.x, ..., each
  // written as its own partial for the merge to fold. Where one CTA takes them all (gridDim.x 1, T 1, or more tiles
  // than the launch has partial slots for) it folds them itself, in order, and writes the output: the same bits.
  int tile_first = 0, tile_step = 1, num_tiles = num_key_tiles(prefill_end);
  bool split = false;
  if (DECODE) {
    const int seq_tiles = num_key_tiles(ctx);
    if (seq_tiles > max_tiles) {
      // The caller's max_context_len is below this context: make the breach visible, not plausible.
      pdl_enter();
      if (blockIdx.x == 0)
        for (int e = threadIdx.x; e < ROWS * HD; e += NT) {
          const int r = row_base + e / HD;  // the same for a warp's 32 lanes
          if (r < num_rows)
            store_out<HD>(out, xq, xs, num_tokens, num_heads, q_start, kvh * group + r, e % HD,
                          __int_as_float(0x7fc00000));
        }
      return;
    }
    split = gridDim.x > 1 && seq_tiles > 1 && seq_tiles <= part_tiles;
    if (split) {
      tile_first = blockIdx.x;
      tile_step = gridDim.x;
    }
    num_tiles = tile_first < seq_tiles && (split || blockIdx.x == 0) ? (seq_tiles - 1 - tile_first) / tile_step + 1 : 0;
    if (num_tiles == 0) {
      pdl_enter();
      return;
    }
  }
  const int kv_end = DECODE ? ctx : prefill_end;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int wm = warp % WARPS_M, wn = warp / WARPS_M;
  const int gid = lane >> 2, tig = lane & 3;
  const int d0 = wn * DTW * 8;  // this warp's first column of O
  const int* table = block_tables + (size_t)seq * max_blocks;

  // Copies the key rows of positions [pos_lo, pos_hi) of the tile at tile_base into stage (K and V alike; rows
  // at or past kv_end are zero-filled, never read). Each thread copies one 16-byte chunk of ROWS_PER_PASS rows
  // per pass.
  constexpr int CPR = HD / 8;
  constexpr int ROWS_PER_PASS = NT / CPR;
  static_assert(BLOCK_N % ROWS_PER_PASS == 0, "tile copy");
  auto copy_rows = [&](int tile_base, int stage, int pos_lo, int pos_hi) {
    const int chunk = threadIdx.x % CPR;
#pragma unroll
    for (int pass = 0; pass < BLOCK_N / ROWS_PER_PASS; ++pass) {
      const int rr = pass * ROWS_PER_PASS + threadIdx.x / CPR;
      const int pos = tile_base + rr;
      if (pos < pos_lo || pos >= pos_hi) continue;
      const bool valid = pos < kv_end;
      size_t offset = 0;
      if (valid) {
        const size_t block = (size_t)table[pos / block_size];
        offset = ((block * block_size + pos % block_size) * num_kv_heads + kvh) * HD + chunk * 8;
      }
      const int dst = (stage * BLOCK_N + rr) * SK + chunk * 8;
      cp_async_16(smem_addr(ks + dst), k_cache + offset, valid);
      cp_async_16(smem_addr(vs + dst), v_cache + offset, valid);
    }
  };
  constexpr int ALL_LO = -0x7fffffff, ALL_HI = 0x7fffffff;
  auto load_tile = [&](int i, int stage) { copy_rows((tile_first + i * tile_step) * BLOCK_N, stage, ALL_LO, ALL_HI); };
  // Decode: the first tile up to this step's token (position ctx - 1) before the wait.
  if (DECODE) {
    copy_rows(tile_first * BLOCK_N, 0, ALL_LO, ctx - 1);
    pdl_enter();
    TRACE_MARK(1);
    copy_rows(tile_first * BLOCK_N, 0, ctx - 1, ALL_HI);
  } else {
    load_tile(0, 0);
  }

  // Q fragments (A operand, row-major 16 x 16 per k-chunk): this lane holds rows gid and gid + 8.
  unsigned qa[KC][4];
  int qpos[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = row_base + wm * 16 + gid + 8 * h;
    const bool valid = r < num_rows;
    const int j = r / group, g = r % group;
    qpos[h] = valid ? ctx - q_len + j : ctx - 1;  // a row past the chunk is never written
    const float* qrow = q + ((size_t)(q_start + j) * num_heads + kvh * group + g) * HD;
#pragma unroll
    for (int kc = 0; kc < KC; ++kc) {
      float2 lo = make_float2(0.f, 0.f), hi = make_float2(0.f, 0.f);
      if (valid) {
        lo = *reinterpret_cast<const float2*>(qrow + kc * 16 + tig * 2);
        hi = *reinterpret_cast<const float2*>(qrow + kc * 16 + 8 + tig * 2);
      }
      qa[kc][h] = pack_half2(lo.x * scale_log2, lo.y * scale_log2);
      qa[kc][h + 2] = pack_half2(hi.x * scale_log2, hi.y * scale_log2);
    }
  }

  if (DECODE) TRACE_MARK(2);

  // The row's folded state (fold mode): running max, sum and O over the tiles folded so far, from the empty state.
  float o[DTW][4];
#pragma unroll
  for (int dt = 0; dt < DTW; ++dt) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.f;
  float row_max[2] = {neg_inf(), neg_inf()};
  float row_sum[2] = {0.f, 0.f};

  cp_async_commit();
  for (int i = 0; i < num_tiles; ++i) {
    const int stage = i % STAGES;
    if (STAGES > 1 && i + 1 < num_tiles) load_tile(i + 1, (i + 1) % STAGES);  // one stage: below
    cp_async_commit();
    cp_async_wait<STAGES - 1>();  // this tile's group is complete
    __syncthreads();
    if (DECODE && i == 0) TRACE_MARK(3);

    const __half* kt = ks + stage * BLOCK_N * SK;
    const __half* vt = vs + stage * BLOCK_N * SK;
    const int tile = tile_first + i * tile_step;
    const int tile_base = tile * BLOCK_N;

    // S = Q K^T: K rows are the B operand's columns, so plain (non-transposed) ldmatrix gives them.
    float s[NS][4];
#pragma unroll
    for (int nt = 0; nt < NS; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll
    for (int kc = 0; kc < KC; ++kc) {
#pragma unroll
      for (int np = 0; np < NS / 2; ++np) {
        unsigned b[4];
        const int key = np * 16 + (lane & 7) + ((lane >> 4) << 3);
        const int col = kc * 16 + (((lane >> 3) & 1) << 3);
        ldmatrix_x4(b, smem_addr(kt + key * SK + col));
        mma_16816(s[2 * np], qa[kc], b[0], b[1]);
        mma_16816(s[2 * np + 1], qa[kc], b[2], b[3]);
      }
    }

    // Keys past the range, and (prefill) past a row's own position, score -inf.
    const bool need_mask = tile_base + BLOCK_N > kv_end || (!DECODE && tile_base + BLOCK_N - 1 > first_qpos);
    if (need_mask) {
#pragma unroll
      for (int nt = 0; nt < NS; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int pos = tile_base + nt * 8 + tig * 2 + (e & 1);
          if (pos >= kv_end || pos > qpos[e >> 1]) s[nt][e] = neg_inf();
        }
    }

    // The tile's partial per row: m_t its max, P = 2^(s - m_t), l_t the sum of P (this lane's 16 in key order, then
    // the quad's by the xor butterfly, every tile), so it depends on the tile alone. A row that sees no key of the
    // tile (prefill, past its position) gets P = 0, l_t = 0 and m_t = -inf, which the fold passes over.
    float tile_max[2], tile_sum[2], a[2], b[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mx = neg_inf();
#pragma unroll
      for (int nt = 0; nt < NS; ++nt) mx = fmaxf(mx, fmaxf(s[nt][2 * h], s[nt][2 * h + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float base = mx == neg_inf() ? 0.f : mx;
      float sum = 0.f;
#pragma unroll
      for (int nt = 0; nt < NS; ++nt) {
        s[nt][2 * h] = exp2f(__fsub_rn(s[nt][2 * h], base));
        s[nt][2 * h + 1] = exp2f(__fsub_rn(s[nt][2 * h + 1], base));
        sum = __fadd_rn(sum, __fadd_rn(s[nt][2 * h], s[nt][2 * h + 1]));
      }
      sum = __fadd_rn(sum, __shfl_xor_sync(0xffffffffu, sum, 1));
      sum = __fadd_rn(sum, __shfl_xor_sync(0xffffffffu, sum, 2));
      tile_max[h] = mx;
      tile_sum[h] = sum;
      if (!split) {
        fold_scales(row_max[h], mx, a[h], b[h]);
        row_sum[h] = fold(row_sum[h], a[h], sum, b[h]);
      }
    }

    // P as mma A fragments: the S accumulators of two adjacent 8-key tiles are exactly one 16-key fragment.
    unsigned pa[BLOCK_N / 16][4];
#pragma unroll
    for (int kc = 0; kc < BLOCK_N / 16; ++kc) {
      pa[kc][0] = pack_half2(s[2 * kc][0], s[2 * kc][1]);
      pa[kc][1] = pack_half2(s[2 * kc][2], s[2 * kc][3]);
      pa[kc][2] = pack_half2(s[2 * kc + 1][0], s[2 * kc + 1][1]);
      pa[kc][3] = pack_half2(s[2 * kc + 1][2], s[2 * kc + 1][3]);
    }

    // O_t = P V, 16 columns at a time from a zero accumulator over the tile's 64 keys in the mma's k order (V rows
    // are the B operand's k dimension, so ldmatrix.trans gives them); then folded into O, or written as the tile's
    // partial.
    const size_t slot = split ? ((size_t)seq * num_heads + kvh * group) * part_tiles + tile : 0;
#pragma unroll
    for (int dp = 0; dp < DTW / 2; ++dp) {
      float ot[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
      for (int kc = 0; kc < BLOCK_N / 16; ++kc) {
        unsigned vb[4];
        const int key = kc * 16 + (lane & 7) + (((lane >> 3) & 1) << 3);
        const int col = d0 + dp * 16 + ((lane >> 4) << 3);
        ldmatrix_x4_trans(vb, smem_addr(vt + key * SK + col));
        mma_16816(ot[0], pa[kc], vb[0], vb[1]);
        mma_16816(ot[1], pa[kc], vb[2], vb[3]);
      }
      if (!split) {
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) o[2 * dp + j][e] = fold(o[2 * dp + j][e], a[e >> 1], ot[j][e], b[e >> 1]);
      } else {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int r = row_base + gid + 8 * h;
          if (r >= num_rows) continue;
          float* dst = part_out + (slot + (size_t)(r % group) * part_tiles) * HD + d0 + dp * 16 + tig * 2;
          *reinterpret_cast<float2*>(dst) = make_float2(ot[0][2 * h], ot[0][2 * h + 1]);
          *reinterpret_cast<float2*>(dst + 8) = make_float2(ot[1][2 * h], ot[1][2 * h + 1]);
        }
      }
    }
    if (split && wn == 0 && tig == 0) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = row_base + gid + 8 * h;
        if (r < num_rows) part_ml[slot + (size_t)(r % group) * part_tiles] = make_float2(tile_max[h], tile_sum[h]);
      }
    }
    __syncthreads();  // the next copy overwrites this stage
    if (STAGES == 1 && i + 1 < num_tiles) load_tile(i + 1, 0);
  }
  cp_async_wait<0>();
  if (DECODE) TRACE_MARK(4);
  if (split) {
    if (DECODE) TRACE_END(TRACE_ATTENTION);
    return;  // the merge folds the partials
  }

  // Every row saw at least one key (its own position's tile 0), so its sum is >= 1.
  float inv[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) inv[h] = __frcp_rn(row_sum[h]);
  if constexpr (!DECODE) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = row_base + wm * 16 + gid + 8 * h;
      if (r >= num_rows) continue;
      // This warp's columns of O. With one warp across the head dim d0 is 0, written as a constant so that HD 64
      // and 128 compile to the instructions they had before HD 256 split the head dim.
      float* orow = out + ((size_t)(q_start + r / group) * num_heads + kvh * group + r % group) * HD +
                    (WARPS_N > 1 ? d0 : 0);
#pragma unroll
      for (int dt = 0; dt < DTW; ++dt)
        *reinterpret_cast<float2*>(orow + dt * 8 + tig * 2) =
            make_float2(finish(o[dt][2 * h], inv[h]), finish(o[dt][2 * h + 1], inv[h]));
    }
  } else {
    // The output, quantized in groups of 32 columns (a group spans warps at HD 64): through the idle tile memory, so
    // that a warp's 32 lanes hold one group.
    float* red = reinterpret_cast<float*>(smem);  // [ROWS][HD]
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int dt = 0; dt < DTW; ++dt)
        *reinterpret_cast<float2*>(red + (gid + 8 * h) * HD + d0 + dt * 8 + tig * 2) =
            make_float2(finish(o[dt][2 * h], inv[h]), finish(o[dt][2 * h + 1], inv[h]));
    }
    __syncthreads();
    for (int e = threadIdx.x; e < ROWS * HD; e += NT) {
      const int r = row_base + e / HD;
      if (r >= num_rows) break;  // rows grow with e, the same for a warp's 32 lanes
      store_out<HD>(out, xq, xs, num_tokens, num_heads, q_start + r / group, kvh * group + r % group, e % HD, red[e]);
    }
  }
  if (DECODE) TRACE_END(TRACE_ATTENTION);
}

}  // namespace attn

using namespace attn;

#define ATTENTION_PARAMS                                                                                       \
  float *__restrict__ out, const float *__restrict__ q, const __half *__restrict__ k_cache,                     \
      const __half *__restrict__ v_cache, const int *__restrict__ block_tables,                                 \
      const int *__restrict__ context_lens, const int *__restrict__ query_starts, float *__restrict__ part_out, \
      float2 *__restrict__ part_ml, int num_heads, int num_kv_heads, int block_size, int max_blocks,            \
      int max_tiles, int part_tiles, float scale_log2, int8_t *__restrict__ xq, ActScale *__restrict__ xs,         \
      int num_tokens
#define ATTENTION_ARGS                                                                                       \
  out, q, k_cache, v_cache, block_tables, context_lens, query_starts, part_out, part_ml, num_heads, num_kv_heads, \
      block_size, max_blocks, max_tiles, part_tiles, scale_log2, xq, xs, num_tokens

// __launch_bounds__(threads, 1): without the 1, ptxas capped these kernels at 128 registers and spilled.
// Registers on sm_80 / sm_89 / sm_90a (scripts/kernel_resources.py, NVRTC 13.5, 2026-12-03, with the tile fold):
//   prefill  HD 64 163 / 163 / 166 (capped at 168: three CTAs an SM), HD 128 245 / 245 / 252, HD 256 255 at all
//            three with 16 bytes spilled (one stage 16 / 16 / 24): values of the output rows' addresses stored
//            before the tile loop and reloaded after it, none inside it
//   decode   HD 64 124 / 126 / 126, HD 128 162 / 164 / 166, HD 256 228 / 234 / 236 (one stage 224 / 228 / 216)
//   merge    157 / 133 / 157 at every head dim (HD threads)
// Before the fold (4e20432): prefill HD 64 148 / 148 / 145, HD 128 199 / 199 / 200, HD 256 224 / 224 / 237, decode
// HD 64 128 / 130 / 126, HD 128 152 / 154 / 152, HD 256 214 / 212 / 213, no spills. The fold's O_t slices, each
// from a zero accumulator, let ptxas hoist V fragments of several slices ahead of their mmas (a dependence of one
// slice's mmas on the previous slice's fold made it worse, 120 bytes spilled at HD 128). The CTAs an SM keep their
// counts: prefill HD 64 three, HD 128 two, HD 256 one; decode HD 128 three.
// At HD 256 prefill's 256 threads fill one SM's register file alone (one CTA an SM).

// Warps that split O's head dim in attention_prefill (the launcher mirrors it): two at HD 256.
template <int HD>
constexpr int prefill_warps_n() {
  return HD > 128 ? 2 : 1;
}

// HD 64: at most 168 registers, so that three CTAs share an SM as before the fold (unbounded ptxas takes 171).
template <int HD>
constexpr int prefill_max_registers() {
  return HD == 64 ? 168 : 255;
}

// grid (ceil(max_query_len * group / 64), num_kv_heads, num_seqs), block 128 * prefill_warps_n<HD>(),
// tile_smem_bytes<HD, STAGES>() dynamic.
template <int HD, int STAGES = 2>
__global__ void __launch_bounds__(128 * prefill_warps_n<HD>(), 1) __maxnreg__(prefill_max_registers<HD>())
    attention_prefill(ATTENTION_PARAMS) {
  pdl_enter();
  attention_tile<HD, 4, prefill_warps_n<HD>(), false, STAGES>(ATTENTION_ARGS);
}

// grid (CTAs per sequence, num_kv_heads, num_seqs * ceil(group / 16)), block 128, tile_smem_bytes<HD, STAGES>()
// dynamic. max_tiles: ceil(max_context_len / 64) (a context past it gets NaN); part_tiles: tile slots per (sequence,
// head) in part_out / part_ml (0 where gridDim.x is 1).
// Waits on the previous kernel inside attention_tile, after its first K/V loads.
template <int HD, int STAGES = 2>
__global__ void __launch_bounds__(128, 1) attention_decode(ATTENTION_PARAMS) {
  attention_tile<HD, 1, 4, true, STAGES>(ATTENTION_ARGS);
}

// grid (num_heads, num_seqs), block HD: the fold of a decode sequence's tile partials, in tile order, from the empty
// state, then out = O / l: the bits of a CTA that folds every tile itself. Only decode sequences (q_len == 1) whose
// tiles attention_decode split (more than one, at most part_tiles).
// Its chain after the wait is one round of loads per MERGE_ROUND partials: the batch metadata is read before the
// wait (uploaded before the step, pdl.cuh), and a round's (m, l) and output elements are loaded at once into
// registers before it folds them. Reading them in the merge's own loops (metadata, then the maxima, then the sums),
// the merge cost ~5 us a layer of llama-3.1-8b's step on the H200 (scripts/ab_skip_ops.py), as much as the decode
// kernel itself; loaded at once, the step took 38.3 us less (docs/performance.md).
template <int HD>
__global__ void __launch_bounds__(HD)
    attention_merge_splits(float* __restrict__ out, const float* __restrict__ part_out,
                           const float2* __restrict__ part_ml, const int* __restrict__ context_lens,
                           const int* __restrict__ query_starts, int num_heads, int part_tiles,
                           int8_t* __restrict__ xq, ActScale* __restrict__ xs, int num_tokens) {
  TRACE_BEGIN();
  const int head = blockIdx.x, seq = blockIdx.y;
  const int q_start = query_starts[seq];
  const bool decode = query_starts[seq + 1] - q_start == 1;
  const int num_tiles = num_key_tiles(context_lens[seq]);
  pdl_enter();
  TRACE_MARK(1);
  if (!decode || num_tiles <= 1 || num_tiles > part_tiles) return;  // written by attention_decode itself
  const size_t first = ((size_t)seq * num_heads + head) * part_tiles;
  float m = neg_inf(), l = 0.f, o = 0.f;
  for (int base = 0; base < num_tiles; base += MERGE_ROUND) {
    float2 ml[MERGE_ROUND];
    float ot[MERGE_ROUND];
#pragma unroll
    for (int t = 0; t < MERGE_ROUND; ++t)
      if (base + t < num_tiles) {
        ml[t] = part_ml[first + base + t];
        ot[t] = part_out[(first + base + t) * HD + threadIdx.x];
      }
    TRACE_MARK(2);
#pragma unroll
    for (int t = 0; t < MERGE_ROUND; ++t)
      if (base + t < num_tiles) {
        float a, b;
        fold_scales(m, ml[t].x, a, b);
        l = fold(l, a, ml[t].y, b);
        o = fold(o, a, ot[t], b);
      }
  }
  store_out<HD>(out, xq, xs, num_tokens, num_heads, q_start, head, threadIdx.x, finish(o, __frcp_rn(l)));
  TRACE_END(TRACE_MERGE);
}
