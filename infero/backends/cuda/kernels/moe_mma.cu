// matvec_experts_mma: a mixture-of-experts layer's grouped expert mat-vecs (matvec.cu's matvec_experts_grouped's
// outputs) on the int8 tensor cores, for the expert types of Q4_K_M / Q5_K_M / Q6_K / Q8_0 files (Q4_K, Q5_K, Q6_K,
// Q8_0). moe_sort (moe.cu) lists the (token, rank) pairs by expert and cuts each expert's run into groups of at most
// G pairs: groups[i] = (expert, first index into order, count). Every pair's output row is bitwise what
// matvec_experts (matvec_q at one token) gives it, whatever G, the group or the pair's place in it.
//
// Layouts. An expert tensor is one matrix of experts x rows GGUF rows (never tiled; expert e's from row e rows),
// up to two of one type and shape a launch (gate and up: ExpertMats). The activation: act_quant.cuh's two int8
// planes xq [2, act_rows, cols] and scales xs [act_rows, cols / 16]; pair order[i] reads row order[i] / per_token and
// writes row order[i] of its segment's out [pairs, rows]. cols: a multiple of 256 (K-quants) or 32 (Q8_0).
//
// Numerics: the linear-layer definition (unit_value.cuh) through mma_units.cuh, each pair's row fx::value of its
// spans' fixed-point sum, so no split or order of the spans matters.
//
// Blocks. grid: (row tiles x segments, an upper bound of the groups); a block past num_groups does nothing. 4 warps;
// a warp computes 16 rows x 16 pairs (4 column tiles of 4 pairs); G / 16 warps split the group's pairs, the others
// the rows: a block holds 64 (G = 16), 32 (G = 32) or 16 (G = 64) rows. The block walks the row's stages (256
// columns, a span: a Q8_0 row's last may be partial) through two shared buffers (mma_units.cuh's staging: the
// activation [8][G][2][32 bytes], its scales [8][G][2], the weights [pieces][rows][16 bytes], Q4_K / Q5_K's {A, B}
// [8][rows]); stage s + 1's copies are issued by cp.async while stage s's mma work runs, one block barrier a stage.
// Only the live column tiles' activations are copied (pairs past the group's count rounded up to 4 are never read).
// Q6_K and Q8_0 stages are 2-byte aligned: each row's stage is copied whole as the 16-byte chunks holding it into a
// raw window ([rows][RAW]: one buffer, its copy issued after the barrier that ends the previous stage's use of it),
// and once it lands the row's THREADS / ROWS threads (lanes of one warp) cut it into the pieces, before the stage's
// barrier. Speed on the H200: "Mixture of experts" in docs/performance.md (scripts/bench_moe_experts.py).
#include "pdl.cuh"
#include "fixed_point.cuh"
#include "mma_units.cuh"

namespace xm {

constexpr int WARPS = 4;

// Blocks an SM holds (launch bounds): Q4_K's and Q5_K's four (128 registers; their two buffers fit four times)
// against three (~148 registers) measured one qwen3-30b-a3b layer's experts at 32 / 512 tokens 313 / 1,261 -> 296 /
// 1,173 us and its synthetic model's prefill of 512 tokens 7,850 -> 8,501-8,588 tok/s (H200, 2026-12-04; a third
// stage buffer at three blocks instead: 310 / 1,219 us, 8,078-8,135 tok/s), in groups of 16 (Q5_K's of 32 spill).
// With the span as straight-line code (a86f0c8) the four spill 8 bytes and still win: 261 / 918 us and 9,885-9,945
// tok/s against three blocks' (no spill, 164 registers) 267 / 945 us and 9,531-9,605. Q6_K spills at 128
// registers, and its windows and Q8_0's leave room for three.
template <int T, int G>
constexpr int blocks_per_sm() {
  return (T == GGML_Q4_K || T == GGML_Q5_K) && G == 16 ? 4 : 3;
}

struct ExpertMats {
  const uint8_t* weight[2];
  float* out[2];
};

}  // namespace xm

template <int T, int G>
__global__ void __launch_bounds__(32 * xm::WARPS, (xm::blocks_per_sm<T, G>()))
    matvec_experts_mma(const __grid_constant__ xm::ExpertMats mats, const int* __restrict__ order,
                       const int4* __restrict__ groups, const int* __restrict__ num_groups, int per_token,
                       const int8_t* __restrict__ xq, const ActScale* __restrict__ xs, int act_rows, int rows,
                       int cols, long long row_bytes) {
  using P = mu::Policy<T>;
  constexpr int WP = G / 16, WR = xm::WARPS / WP, ROWS = 16 * WR, NT = 4, KU = mu::KU, THREADS = 32 * xm::WARPS;
  constexpr int ACT_BYTES = 640 * G, W_BYTES = 16 * P::PIECES * ROWS;
  constexpr int BUF_BYTES = ACT_BYTES + W_BYTES + (P::PREP ? 8 * KU * ROWS : 0);  // moe.mma_shared
  // !ASYNC: a row's raw window (its stage's bytes from 14 past a 16-byte boundary at most) and its threads.
  constexpr int RAW = 16 * ((14 + P::BYTES + 15) / 16), RQ = THREADS / ROWS;
  static_assert(G % 16 == 0 && WP <= xm::WARPS, "G: 16, 32 or 64");
  static_assert(32 % RQ == 0, "a row's threads are lanes of one warp");
  extern __shared__ __align__(16) uint8_t smem[];  // two stage buffers, stage s in buffer s % 2; then the raw windows
  __shared__ int arow[G];
  const int units = cols / 32, stages = (units + KU - 1) / KU;
  const int tiles = (rows + ROWS - 1) / ROWS;
  const int seg = blockIdx.x / tiles, row0 = (blockIdx.x % tiles) * ROWS;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, j = lane & 3;
  const int wp = warp % WP, rl = 16 * (warp / WP) + g;
  pdl_enter();  // the groups and the activation are earlier kernels' output
  if ((int)blockIdx.y >= *num_groups) return;
  const int4 group = groups[blockIdx.y];
  const int n = group.z;
  const uint8_t* weight = (seg ? mats.weight[1] : mats.weight[0]) + (long long)group.x * rows * row_bytes;
  if (tid < G) arow[tid] = order[group.y + min(tid, n - 1)] / per_token;
  const int8_t* xq1 = xq + (long long)act_rows * cols;
  const bool active = 16 * wp < n;
  __syncthreads();  // arow, for the copies

  auto stage_of = [&](int r, int st) {
    return mu::stage_at<T>(weight, min(row0 + r, rows - 1), st, row_bytes, false);
  };
  // Stage st's copies into buffer st % 2 by cp.async (no registers: they overlap the previous stage's mma work): the
  // live tiles' activation slices, their scales (a unit's two halves at once) and the weights, where 16-byte aligned
  // (ASYNC) as pieces, else as the chunks of each row's raw window (this thread's share of row rr's).
  const int live = min(G, (n + 3) & ~3);
  const int rr = tid / RQ, rq = tid % RQ;
  uint8_t* raw = smem + 2 * BUF_BYTES + rr * RAW;
  auto issue = [&](int st) {
    const int u0 = st * KU, valid = min(KU, units - u0);
    uint8_t* sb = smem + (st & 1) * BUF_BYTES;
    ActScale* ss = reinterpret_cast<ActScale*>(sb + 512 * G);
    for (int i = tid; i < 4 * KU * G; i += THREADS) {
      const int plane = (i >> 1) & 1, p = (i >> 2) % G, k = (i >> 2) / G;
      if (k < valid && p < live)
        tc::cp_async<16>(sb + 16 * i, (plane ? xq1 : xq) + (long long)arow[p] * cols + 32 * (u0 + k) + 16 * (i & 1));
    }
    for (int i = tid; i < KU * G; i += THREADS)
      if (i / G < valid && i % G < live)
        tc::cp_async<16>(ss + 2 * i, xs + (long long)arow[i % G] * (cols / 16) + 2 * (u0 + i / G));
    if constexpr (P::ASYNC) {
      uint8_t* sa = sb + ACT_BYTES;
      for (int i = tid; i < P::PIECES * ROWS; i += THREADS)
        tc::cp_async<16>(sa + 16 * i, P::piece_at(stage_of(i % ROWS, st), i / ROWS));
    } else {
      const uint8_t* stage = stage_of(rr, st);
      const uint8_t* base = reinterpret_cast<const uint8_t*>(reinterpret_cast<unsigned long long>(stage) & ~15ull);
      const int chunks = (int)((stage - base) + P::stage_bytes(valid) + 15) / 16;
      for (int c = rq; c < chunks; c += RQ) tc::cp_async<16>(raw + 16 * c, base + 16 * c);
    }
  };

  fx::Sum sum[NT][2];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) sum[nt][0] = sum[nt][1] = fx::zero();
  issue(0);
  tc::cp_async_commit();
  for (int st = 0; st < stages; ++st) {
    const int valid = min(KU, units - st * KU);
    uint8_t* sb = smem + (st & 1) * BUF_BYTES;
    tc::cp_async_wait<0>();
    if constexpr (!P::ASYNC) {  // row rr's raw window landed (its lanes' copies): its pieces into the buffer
      __syncwarp();
      const int offset = (int)(reinterpret_cast<unsigned long long>(stage_of(rr, st)) & 15);
      uint4* sa = reinterpret_cast<uint4*>(sb + ACT_BYTES);
      for (int i = rq; i < P::PIECES; i += RQ) sa[i * ROWS + rr] = P::template piece<false>(raw + offset, i, valid);
    }
    mu::scales<T>(reinterpret_cast<ActScale*>(sb + 512 * G), KU * G, tid, THREADS);
    mu::prep<T>(reinterpret_cast<float2*>(sb + ACT_BYTES + W_BYTES), sb + ACT_BYTES, ROWS, tid);
    __syncthreads();  // stage st landed for every thread; every warp done with stage st - 1, whose buffer st + 1 takes
    if (st + 1 < stages) issue(st + 1);
    tc::cp_async_commit();
    const float2* dm = reinterpret_cast<const float2*>(sb + 512 * G);
    const float2* ab = reinterpret_cast<const float2*>(sb + ACT_BYTES + W_BYTES);
    // The warp's live column tiles: those with a pair below n. Only Q8_0 rows (32-column blocks) end inside a stage.
    if (active)
      mu::span<T, NT, T == GGML_Q8_0>(sum, sb + ACT_BYTES, ab, sb, dm, ROWS, G, rl, 16 * wp, (n - 16 * wp + 3) / 4,
                                      valid, g, j);
  }
  if (!active) return;
  float* out = seg ? mats.out[1] : mats.out[0];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const int pair = 16 * wp + 4 * nt + j;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = row0 + rl + 8 * h;
      if (pair < n && row < rows) out[(long long)order[group.y + pair] * rows + row] = fx::value(sum[nt][h]);
    }
  }
}
