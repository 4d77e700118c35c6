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
// Numerics: matvec_q's units (mma_units.cuh: each unit's fp32 contribution bitwise what mv::Unit<T>::dot gives).
//
// Sums (batch invariance, docs/kernels.md rule 2): a pair's row is fx::value of the fixed-point sum of its units'
// contributions (fixed_point.cuh), the definition matvec_q's rows follow, so no order of the units matters. The
// block stages the row's units in 8 chunks (u % 8 == s: for the K-quants the quants at one offset of every
// superblock), each chunk's weights, activations and scales in shared memory, and walks them in turn.
//
// Blocks. grid: (row tiles x segments, an upper bound of the groups); a block past num_groups does nothing. 4 warps;
// a warp computes 16 rows x 16 pairs (4 column tiles of 4 pairs); G / 16 warps split the group's pairs, the others
// the rows: a block holds 64 (G = 16), 32 (G = 32) or 16 (G = 64) rows. Shared memory per chunk (ceil(units / 8)
// units): activations [units][2 runs][G][2 planes][16 bytes] (lane (g, j)'s B words at 16 g + 4 j: conflict free),
// scales [units][G][2 runs], weights [units][pieces][rows][16 bytes] and, for Q6_K / Q8_0, a word a (unit, row).
// Two buffers: chunk s + 1 is copied by cp.async while chunk s's mma work runs, one block barrier a chunk. Q6_K and
// Q8_0 blocks are 2-byte aligned: their weight pieces come from the 4-byte words around them, through registers, just
// before their chunk's barrier. Speed on the H200: not measured yet (scripts/bench_moe_experts.py, its --mma groups).
#include "pdl.cuh"
#include "fixed_point.cuh"
#include "mma_units.cuh"

namespace xm {

constexpr int WARPS = 4;

struct ExpertMats {
  const uint8_t* weight[2];
  float* out[2];
};

}  // namespace xm

template <int T, int G>
__global__ void __launch_bounds__(32 * xm::WARPS, 3) matvec_experts_mma(const __grid_constant__ xm::ExpertMats mats,
                                                                    const int* __restrict__ order,
                                                                    const int4* __restrict__ groups,
                                                                    const int* __restrict__ num_groups, int per_token,
                                                                    const int8_t* __restrict__ xq,
                                                                    const ActScale* __restrict__ xs, int act_rows,
                                                                    int rows, int cols, long long row_bytes) {
  using P = mu::Policy<T>;
  constexpr int WP = G / 16, WR = xm::WARPS / WP, ROWS = 16 * WR, NT = 4;
  static_assert(G % 16 == 0 && WP <= xm::WARPS, "G: 16, 32 or 64");
  extern __shared__ __align__(16) uint8_t smem[];  // two chunk buffers, chunk c in buffer c % 2
  __shared__ int arow[G];
  const int units = cols / 32, chunk = (units + 7) / 8;
  // A buffer: activations [chunk][2][G][2][16], scales [chunk][G][2], weights [chunk][PIECES][ROWS][16], words
  // [chunk][ROWS] (moe.mma_shared).
  const int act_bytes = 80 * chunk * G, buf_bytes = act_bytes + chunk * ROWS * (16 * P::PIECES + (P::EXTRA ? 4 : 0));
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

  // Chunk s's copies into its buffer by cp.async (no registers: they overlap the previous chunk's mma work): the
  // activation slices, their scales and, where 16-byte aligned (ASYNC), the weight pieces.
  auto issue = [&](int s) {
    const int count = (units - s + 7) / 8;
    uint8_t* sb = smem + (s & 1) * buf_bytes;
    ActScale* ss = reinterpret_cast<ActScale*>(sb + 64 * chunk * G);
    for (int i = tid; i < 4 * count * G; i += 32 * xm::WARPS) {
      const int plane = i & 1, p = (i >> 1) % G, jr = (i >> 1) / G;
      tc::cp_async<16>(sb + 16 * i, (plane ? xq1 : xq) + (long long)arow[p] * cols + 16 * P::act(s + 8 * (jr >> 1), jr & 1));
    }
    for (int i = tid; i < 2 * count * G; i += 32 * xm::WARPS)
      tc::cp_async<8>(ss + i, xs + (long long)arow[(i >> 1) % G] * (cols / 16) + P::act(s + 8 * ((i >> 1) / G), i & 1));
    if constexpr (P::ASYNC) {
      uint8_t* sa = sb + act_bytes;
      for (int i = tid; i < count * P::PIECES * ROWS; i += 32 * xm::WARPS) {
        const int r = i % ROWS, jp = i / ROWS, u = s + 8 * (jp / P::PIECES);
        const uint8_t* b = mu::block_at<T>(weight, min(row0 + r, rows - 1), u, row_bytes, false);
        tc::cp_async<16>(sa + 16 * i, P::piece_at(b, mu::place<T>(u), jp % P::PIECES));
      }
    }
  };

  fx::Sum sum[NT][2];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) sum[nt][0] = sum[nt][1] = fx::zero();
  issue(0);
  tc::cp_async_commit();
  for (int s = 0; s < 8; ++s) {
    const int count = (units - s + 7) / 8;  // units s, s + 8, ... of a row
    const uint8_t* sb = smem + (s & 1) * buf_bytes;
    const ActScale* ss = reinterpret_cast<const ActScale*>(sb + 64 * chunk * G);
    uint8_t* sa = smem + (s & 1) * buf_bytes + act_bytes;
    uint32_t* sx = reinterpret_cast<uint32_t*>(sa + 16 * chunk * P::PIECES * ROWS);
    if constexpr (!P::ASYNC) {  // 2-byte aligned pieces, realigned in registers (the buffer's chunk s - 2 is done)
#pragma unroll 4
      for (int i = tid; i < count * P::PIECES * ROWS; i += 32 * xm::WARPS) {
        const int r = i % ROWS, jp = i / ROWS, u = s + 8 * (jp / P::PIECES);
        const uint8_t* b = mu::block_at<T>(weight, min(row0 + r, rows - 1), u, row_bytes, false);
        *reinterpret_cast<uint4*>(sa + 16 * i) = P::piece(b, mu::place<T>(u), jp % P::PIECES);
      }
      for (int i = tid; i < count * ROWS; i += 32 * xm::WARPS) {
        const int u = s + 8 * (i / ROWS);
        sx[i] = P::extra(mu::block_at<T>(weight, min(row0 + i % ROWS, rows - 1), u, row_bytes, false), mu::place<T>(u));
      }
    }
    tc::cp_async_wait<0>();
    {  // the scales this thread copied: each half's sum as a float in place (exact: |s| < 2^24), once per chunk
      int* sums = reinterpret_cast<int*>(smem + (s & 1) * buf_bytes + 64 * chunk * G);
      for (int i = tid; i < 2 * count * G; i += 32 * xm::WARPS)
        sums[2 * i + 1] = __float_as_int((float)sums[2 * i + 1]);
    }
    __syncthreads();  // chunk s landed for every thread; every warp done with chunk s - 1, whose buffer s + 1 takes
    if (s < 7) issue(s + 1);
    tc::cp_async_commit();
    // A warp's 4 column tiles all live (the common case) run without a test between their mma chains.
    auto compute = [&](auto whole) {
      for (int k = 0; k < count; ++k) {
        const int u = s + 8 * k;
        uint32_t a[4];
        typename P::Scale sc[2];
        P::frag(a, sc, sa + 16 * k * P::PIECES * ROWS, sx + k * ROWS, ROWS, rl, u, j);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          const int pb = 16 * wp + 4 * nt;
          if (!decltype(whole)::value && pb >= n) break;
          const uint8_t* b = sb + 32 * (2 * k * G + pb) + 16 * g + 4 * j;
          float dot[2][2];
          mu::dots<P::SPLIT>(dot, a, mu::word(b), mu::word(b + 32 * G));
          const int4 v = *reinterpret_cast<const int4*>(ss + 2 * (k * G + pb + j));  // {D, s} of runs 0, 1
          const float ad[2] = {__int_as_float(v.x), __int_as_float(v.z)};
          const float fs[2] = {__int_as_float(v.y), __int_as_float(v.w)};  // the half sums, made floats above
#pragma unroll
          for (int h = 0; h < 2; ++h) fx::add(sum[nt][h], P::unit(sc[h], dot[h], ad, fs));
        }
      }
    };
    if (16 * wp + 4 * NT <= n) {
      compute(mu::Flag<true>());
    } else if (active) {
      compute(mu::Flag<false>());
    }
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
