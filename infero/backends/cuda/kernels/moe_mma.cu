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
// Numerics: matvec_q's. A unit is 32 elements in two 16-element runs (mv::Unit<T>: for the K-quants 16 bytes of a
// superblock's quants, for Q8_0 a block). mma.m16n8k32 s8 x s8 computes each run's two plane dots exactly as
// __dp4a does (an integer sum is exact in any order): the A fragment holds 16 rows x the unit's 32 weights (k 0-15
// run 0, k 16-31 run 1, lane (g, j) elements 4j..4j+3 of each), B column c plane c % 2 of pair c / 2 over the same
// elements, so C's column pair j is pair j's (plane 0, plane 1) dots of rows g and g + 8. The K-quants scale each run
// apart: their mma is issued once per run with the other run's half of B zero; Q8_0 sums both runs in one. A unit's
// float contribution is then unit_expr.cuh's expression, the one matvec_q's units use, on the same fp32 inputs
// computed without an int-to-float conversion: the mma adds each plane dot c (|c| < 2^22) to
// EXACT, whose bits as a float are 1.5 2^23 + c exactly; fmaf(256, c0, c1) then rounds 256 c0 + c1 once, as
// (float)(256 c0 + c1) does (exactly, where that is below 2^24: the K-quants' run dots, Q6_K's with its weights
// stored - 32 by the fragment so that the dot is dot - 32 s). matvec_q's (float)(sc dot) and (float)(m s) round an
// exact integer product once; here the same product of two exact floats, rounded once: the same bits.
//
// Reduction order (batch invariance). matvec_q's lane l sums units l, l + 32, ... in order from 0.f, then an xor
// butterfly (16, 8, 4, 2, 1) adds the 32 lane sums. Read with lanes in bit-reversed order (position p = rev5(l)) the
// butterfly is the binary tree over consecutive positions, so each lane sum is formed in its turn (cur) and pushed
// into a binary counter of partial trees (level[b]: the tree of the 2^b positions before the current run of ones):
// the same additions of the same operands. Positions 4c .. 4c + 3 are the lanes s, s + 16, s + 8, s + 24 with
// s = rev3(c): the units u with u % 8 == s, for the K-quants the quants at one offset of every superblock. So the
// block stages the row's units in 8 chunks (u % 8 == s), each chunk's weights, activations and scales in shared
// memory, and walks the chunks in that order.
//
// Blocks. grid: (row tiles x segments, an upper bound of the groups); a block past num_groups does nothing. 4 warps;
// a warp computes 16 rows x 16 pairs (4 column tiles of 4 pairs); G / 16 warps split the group's pairs, the others
// the rows: a block holds 64 (G = 16), 32 (G = 32) or 16 (G = 64) rows. Shared memory per chunk (ceil(units / 8)
// units): activations [units][2 runs][G][2 planes][16 bytes] (lane (g, j)'s B words at 16 g + 4 j: conflict free),
// scales [units][G][2 runs], weights [units][pieces][rows][16 bytes] and, for Q6_K / Q8_0, a word a (unit, row).
// Two buffers: chunk c + 1 is copied by cp.async while chunk c's mma work runs, one block barrier a chunk. Q6_K and
// Q8_0 blocks are 2-byte aligned: their weight pieces come from the 4-byte words around them, through registers, just
// before their chunk's barrier. Speed on the H200: not measured yet (scripts/bench_moe_experts.py, its --mma groups).
#include "pdl.cuh"
#include "act_quant.cuh"
#include "unit_expr.cuh"
#include "tensor_core.cuh"

namespace xm {

constexpr int WARPS = 4;

struct ExpertMats {
  const uint8_t* weight[2];
  float* out[2];
};

__device__ __forceinline__ float f16_lo(uint32_t w) { return __half2float(__ushort_as_half((unsigned short)(w & 0xFFFFu))); }
__device__ __forceinline__ float f16_hi(uint32_t w) { return __half2float(__ushort_as_half((unsigned short)(w >> 16))); }

// 16 bytes at a 2-byte aligned p from the 4-byte words holding them (the last one found from p's byte 15, so no
// word without a requested byte is read), shifted into place.
__device__ __forceinline__ uint4 load16_at2(const uint8_t* p) {
  const unsigned long long a = reinterpret_cast<unsigned long long>(p);
  const uint32_t* w = reinterpret_cast<const uint32_t*>(a & ~3ull);
  uint32_t v[5];
#pragma unroll
  for (int i = 0; i < 4; ++i) v[i] = __ldg(w + i);
  v[4] = __ldg(reinterpret_cast<const uint32_t*>((a + 15) & ~3ull));
  const int sh = 8 * (int)(a & 3);
  return make_uint4(__funnelshift_r(v[0], v[1], sh), __funnelshift_r(v[1], v[2], sh), __funnelshift_r(v[2], v[3], sh),
                    __funnelshift_r(v[3], v[4], sh));
}

__device__ __forceinline__ uint32_t word(const uint8_t* p) { return *reinterpret_cast<const uint32_t*>(p); }

// An int v with |v| < 2^22, biased by EXACT (EXACT + v: what the mma leaves from an accumulator of EXACT), as a float.
constexpr int EXACT = 0x4B400000;  // 1.5 2^23 as a float's bits
__device__ __forceinline__ float exact_float(int biased) { return __fsub_rn(__int_as_float(biased), 12582912.f); }
__device__ __forceinline__ float small_float(int v) { return exact_float(EXACT + v); }

// ---- formats ------------------------------------------------------------------------------------------------------
// Policy<T>: PIECES 16-byte pieces (and with EXTRA a word) staged per (unit, row); piece_at(row, u, i) (ASYNC: 16-byte
// aligned, copied by cp.async) or piece(row, u, i) and extra(row, u) read them from the GGUF row; act(u, r): run r's activation half (2 group + half, mv::Unit<T>::runs); frag() the
// lane's A words of m-rows g and g + 8 and their scales (as exact floats) from the staged unit; unit() the unit's
// float contribution from its run dots (dots(), as floats) and the pair's run scales (unit_expr.cuh).

template <int T> struct Policy;

// Q4_K / Q5_K: unit u = 16 bytes of qs, superblock u / 8, k = u % 8: low nibbles sub-block 2 (k / 2) (run 0), high
// nibbles 2 (k / 2) + 1 (run 1), elements 16 (k % 2) + i; Q5_K's fifth bits in qh[16 (k % 2) + i], bits k / 2 * 2
// and + 1.
template <int T>
struct PolicyK45 {
  static constexpr int BYTES = T == GGML_Q4_K ? 144 : 176, QS = T == GGML_Q4_K ? 16 : 48;
  static constexpr int PIECES = T == GGML_Q4_K ? 2 : 3;  // qs, header (d, dmin, scales) [, qh]
  static constexpr bool EXTRA = false, SPLIT = true, ASYNC = true;
  struct Scale { float d, dmin, sc[2], m[2]; };
  __device__ static int act(int u, int r) { return 2 * ((u >> 3) * 8 + ((u & 7) >> 1) * 2 + r) + (u & 1); }
  __device__ static const uint8_t* piece_at(const uint8_t* row, int u, int i) {
    const uint8_t* b = row + (long long)(u >> 3) * BYTES;
    const int k = u & 7;
    return i == 0 ? b + QS + 16 * k : i == 1 ? b : b + 16 + 16 * (k & 1);
  }
  __device__ static void frag(uint32_t (&a)[4], Scale (&sc)[2], const uint8_t* unit, const uint32_t*, int rows, int rl,
                              int u, int j) {
    const int c = (u & 7) >> 1;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = rl + 8 * h;
      const uint32_t qs = word(unit + 16 * r + 4 * j);
      a[h] = qs & 0x0F0F0F0Fu;
      a[2 + h] = (qs >> 4) & 0x0F0F0F0Fu;
      if constexpr (T == GGML_Q5_K) {
        const uint32_t qh = word(unit + 16 * (2 * rows + r) + 4 * j);
        a[h] |= ((qh >> (2 * c)) & 0x01010101u) << 4;
        a[2 + h] |= ((qh >> (2 * c + 1)) & 0x01010101u) << 4;
      }
      const uint4 hd = *reinterpret_cast<const uint4*>(unit + 16 * (rows + r));
      const uint32_t w[4] = {hd.x, hd.y, hd.z, hd.w};
      int scale[2], min[2];
      quant::k4_scales_mins(w, c, scale, min);
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        sc[h].sc[r] = small_float(scale[r]);
        sc[h].m[r] = small_float(min[r]);
      }
      sc[h].d = f16_lo(hd.x);
      sc[h].dmin = f16_hi(hd.x);
    }
  }
  // |dot| < 16 * 31 * 32639 < 2^24: exact, so sc dot and m s are rounded once each, as matvec_q's.
  __device__ static float unit(const Scale& s, const float (&dot)[2], const float (&ad)[2], const float (&fs)[2]) {
    const float scdot[2] = {__fmul_rn(s.sc[0], dot[0]), __fmul_rn(s.sc[1], dot[1])};
    const float ms[2] = {__fmul_rn(s.m[0], fs[0]), __fmul_rn(s.m[1], fs[1])};
    return ue::k45(s.d, s.dmin, scdot, ms, ad);
  }
};
template <> struct Policy<GGML_Q4_K> : PolicyK45<GGML_Q4_K> {};
template <> struct Policy<GGML_Q5_K> : PolicyK45<GGML_Q5_K> {};

// Q6_K: unit u = 16 bytes of ql, superblock u / 8, k = u % 8, h = k / 4: low nibbles elements 128 h + 16 (k % 4) + i
// (run 0), high nibbles + 64 (run 1); their high bits in qh[32 h + 16 (k % 2) + i], bit pairs s0 = 2 (k % 4 / 2) and
// s0 + 4; scales 8 h + k % 4 and + 4. The word: scale 0 | scale 1 << 8 | d << 16. The fragment holds q - 32, so a
// run's dot is matvec_q's dot - 32 s (|dot - 32 s| <= 32 * 16 * 32639 < 2^24: exact as a float).
template <>
struct Policy<GGML_Q6_K> {
  static constexpr int PIECES = 2;  // ql, qh
  static constexpr bool EXTRA = true, SPLIT = true, ASYNC = false;
  struct Scale { float d, sc[2]; };
  __device__ static int act(int u, int r) { return 2 * ((u >> 3) * 8 + ((u & 7) >> 2) * 4 + ((u & 3) >> 1) + 2 * r) + (u & 1); }
  __device__ static uint4 piece(const uint8_t* row, int u, int i) {
    const uint8_t* b = row + (long long)(u >> 3) * 210;
    const int k = u & 7;
    return load16_at2(i == 0 ? b + 16 * k : b + 128 + 32 * (k >> 2) + 16 * (k & 1));
  }
  __device__ static uint32_t extra(const uint8_t* row, int u) {
    const uint8_t* b = row + (long long)(u >> 3) * 210;
    const int k = u & 7;
    return (uint32_t)__ldg(b + 192 + 8 * (k >> 2) + (k & 3)) | ((uint32_t)__ldg(b + 196 + 8 * (k >> 2) + (k & 3)) << 8) |
           ((uint32_t)__ldg(reinterpret_cast<const unsigned short*>(b + 208)) << 16);
  }
  __device__ static void frag(uint32_t (&a)[4], Scale (&sc)[2], const uint8_t* unit, const uint32_t* x, int rows, int rl,
                              int u, int j) {
    const int s0 = 2 * ((u & 3) >> 1);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = rl + 8 * h;
      const uint32_t ql = word(unit + 16 * r + 4 * j), qh = word(unit + 16 * (rows + r) + 4 * j);
      a[h] = __vsub4((ql & 0x0F0F0F0Fu) | ((qh << (4 - s0)) & 0x30303030u), 0x20202020u);
      a[2 + h] = __vsub4(((ql >> 4) & 0x0F0F0F0Fu) | ((qh >> s0) & 0x30303030u), 0x20202020u);
      const uint32_t e = x[r];
      sc[h].sc[0] = small_float((int)(int8_t)(e & 0xFFu));
      sc[h].sc[1] = small_float((int)(int8_t)((e >> 8) & 0xFFu));
      sc[h].d = f16_hi(e);
    }
  }
  __device__ static float unit(const Scale& s, const float (&dot)[2], const float (&ad)[2], const float (&)[2]) {
    const float i[2] = {__fmul_rn(s.sc[0], dot[0]), __fmul_rn(s.sc[1], dot[1])};
    return ue::q6k(s.d, i, ad);
  }
};

// Q8_0: unit u = block u (d, then 32 int8 weights); runs 0 and 1 are the halves of activation group u, summed in
// integers before the scale (mv::Unit50::dot), so one mma takes the whole block. The word: d.
template <>
struct Policy<GGML_Q8_0> {
  static constexpr int PIECES = 2;  // weights 0-15, 16-31
  static constexpr bool EXTRA = true, SPLIT = false, ASYNC = false;
  struct Scale { float d; };
  __device__ static int act(int u, int r) { return 2 * u + r; }
  __device__ static uint4 piece(const uint8_t* row, int u, int i) { return load16_at2(row + 34LL * u + 2 + 16 * i); }
  __device__ static uint32_t extra(const uint8_t* row, int u) {
    return __ldg(reinterpret_cast<const unsigned short*>(row + 34LL * u));
  }
  __device__ static void frag(uint32_t (&a)[4], Scale (&sc)[2], const uint8_t* unit, const uint32_t* x, int rows, int rl,
                              int u, int j) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = rl + 8 * h;
      a[h] = word(unit + 16 * r + 4 * j);
      a[2 + h] = word(unit + 16 * (rows + r) + 4 * j);
      sc[h].d = f16_lo(x[r]);
    }
  }
  __device__ static float unit(const Scale& s, const float (&dot)[2], const float (&ad)[2], const float (&)[2]) {
    return ue::block32(s.d, ad[0], dot[0]);
  }
};

// The run dots of m-rows g (h = 0) and g + 8 (h = 1) of the lane's pair: dot[h][r] = (float)(256 dot(q, x0) +
// dot(q, x1)) (Q8_0: dot[h][0], both runs). A plane dot is at most 32 * 128 * 127 < 2^22.
__device__ __forceinline__ float plane_dots(const int (&c)[4], int h) {
  return __fmaf_rn(256.f, exact_float(c[2 * h]), exact_float(c[2 * h + 1]));
}
template <bool SPLIT>
__device__ __forceinline__ void dots(float (&dot)[2][2], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (SPLIT) {
    int c0[4], c1[4];
    tc::mma_16832_s8s8(c0, a, b0, 0u, EXACT);
    tc::mma_16832_s8s8(c1, a, 0u, b1, EXACT);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      dot[h][0] = plane_dots(c0, h);
      dot[h][1] = plane_dots(c1, h);
    }
  } else {
    int c[4];
    tc::mma_16832_s8s8(c, a, b0, b1, EXACT);
#pragma unroll
    for (int h = 0; h < 2; ++h) dot[h][0] = dot[h][1] = plane_dots(c, h);
  }
}

// Lane sums x of position p (p = 0, 1, ..., 31) into the binary counter; at p = 31 x leaves as the butterfly's totals.
template <int K>
__device__ __forceinline__ void push(float (&x)[K], float (&level)[5][K], int p) {
  bool open = true;
#pragma unroll
  for (int b = 0; b < 5; ++b) {
    if (open) {
      if ((p >> b) & 1) {
#pragma unroll
        for (int i = 0; i < K; ++i) x[i] = __fadd_rn(level[b][i], x[i]);
      } else {
#pragma unroll
        for (int i = 0; i < K; ++i) level[b][i] = x[i];
        open = false;
      }
    }
  }
}

}  // namespace xm

template <int T, int G>
__global__ void __launch_bounds__(32 * xm::WARPS, 3) matvec_experts_mma(const __grid_constant__ xm::ExpertMats mats,
                                                                    const int* __restrict__ order,
                                                                    const int4* __restrict__ groups,
                                                                    const int* __restrict__ num_groups, int per_token,
                                                                    const int8_t* __restrict__ xq,
                                                                    const ActScale* __restrict__ xs, int act_rows,
                                                                    int rows, int cols, long long row_bytes) {
  using P = xm::Policy<T>;
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

  // Chunk c's copies into its buffer by cp.async (no registers: they overlap the previous chunk's mma work): the
  // activation slices, their scales and, where 16-byte aligned (ASYNC), the weight pieces.
  auto issue = [&](int c) {
    const int s = ((c & 1) << 2) | (c & 2) | (c >> 2), count = (units - s + 7) / 8;
    uint8_t* sb = smem + (c & 1) * buf_bytes;
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
        const int r = i % ROWS, jp = i / ROWS;
        const uint8_t* row = weight + (long long)min(row0 + r, rows - 1) * row_bytes;
        tc::cp_async<16>(sa + 16 * i, P::piece_at(row, s + 8 * (jp / P::PIECES), jp % P::PIECES));
      }
    }
  };

  float cur[2 * NT], level[5][2 * NT];
#pragma unroll
  for (int b = 0; b < 5; ++b)
#pragma unroll
    for (int i = 0; i < 2 * NT; ++i) level[b][i] = 0.f;
  issue(0);
  tc::cp_async_commit();
  for (int c = 0; c < 8; ++c) {
    const int s = ((c & 1) << 2) | (c & 2) | (c >> 2);  // rev3(c)
    const int count = (units - s + 7) / 8;               // units s, s + 8, ... of a row
    const uint8_t* sb = smem + (c & 1) * buf_bytes;
    const ActScale* ss = reinterpret_cast<const ActScale*>(sb + 64 * chunk * G);
    uint8_t* sa = smem + (c & 1) * buf_bytes + act_bytes;
    uint32_t* sx = reinterpret_cast<uint32_t*>(sa + 16 * chunk * P::PIECES * ROWS);
    if constexpr (!P::ASYNC) {  // 2-byte aligned pieces, realigned in registers (the buffer's chunk c - 2 is done)
#pragma unroll 4
      for (int i = tid; i < count * P::PIECES * ROWS; i += 32 * xm::WARPS) {
        const int r = i % ROWS, jp = i / ROWS;
        const uint8_t* row = weight + (long long)min(row0 + r, rows - 1) * row_bytes;
        *reinterpret_cast<uint4*>(sa + 16 * i) = P::piece(row, s + 8 * (jp / P::PIECES), jp % P::PIECES);
      }
      for (int i = tid; i < count * ROWS; i += 32 * xm::WARPS)
        sx[i] = P::extra(weight + (long long)min(row0 + i % ROWS, rows - 1) * row_bytes, s + 8 * (i / ROWS));
    }
    tc::cp_async_wait<0>();
    __syncthreads();  // chunk c landed for every thread; every warp done with chunk c - 1, whose buffer c + 1 takes
    if (c < 7) issue(c + 1);
    tc::cp_async_commit();
    if (!active) continue;
#pragma unroll
    for (int q = 0; q < 4; ++q) {  // position 4 c + q: lane s + 8 rev2(q), its units s + 8 (rev2(q) + 4 i)
#pragma unroll
      for (int i = 0; i < 2 * NT; ++i) cur[i] = 0.f;
      for (int k = ((q & 1) << 1) | (q >> 1); k < count; k += 4) {
        const int u = s + 8 * k;
        uint32_t a[4];
        typename P::Scale sc[2];
        P::frag(a, sc, sa + 16 * k * P::PIECES * ROWS, sx + k * ROWS, ROWS, rl, u, j);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          const int pb = 16 * wp + 4 * nt;
          if (pb >= n) break;
          const uint8_t* b = sb + 32 * (2 * k * G + pb) + 16 * g + 4 * j;
          float dot[2][2];
          xm::dots<P::SPLIT>(dot, a, xm::word(b), xm::word(b + 32 * G));
          const int4 v = *reinterpret_cast<const int4*>(ss + 2 * (k * G + pb + j));  // {D, s} of runs 0, 1
          const float ad[2] = {__int_as_float(v.x), __int_as_float(v.z)};
          const float fs[2] = {xm::small_float(v.y), xm::small_float(v.w)};  // |s| <= 16 * 32639
#pragma unroll
          for (int h = 0; h < 2; ++h) cur[2 * nt + h] = __fadd_rn(cur[2 * nt + h], P::unit(sc[h], dot[h], ad, fs));
        }
      }
      xm::push(cur, level, 4 * c + q);
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
      if (pair < n && row < rows) out[(long long)order[group.y + pair] * rows + row] = cur[2 * nt + h];
    }
  }
}
