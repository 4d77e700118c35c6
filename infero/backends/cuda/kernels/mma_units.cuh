// The mat-vec's units on the int8 tensor cores, shared by the kernels that compute matvec_q's unit contributions
// from mma.sync integer sums: moe_mma.cu's matvec_experts_mma and linear_mma.cu's linear_mma. Types: Q4_K, Q5_K,
// Q6_K, Q8_0.
//
// Numerics: matvec_q's. A unit is 32 elements in two 16-element runs (mv::Unit<T>: for the K-quants 16 bytes of a
// superblock's quants, for Q8_0 a block). mma.m16n8k32 s8 x s8 computes each run's two plane dots exactly as
// __dp4a does (an integer sum is exact in any order): the A fragment holds 16 rows x the unit's 32 weights (k 0-15
// run 0, k 16-31 run 1, lane (g, j) elements 4j..4j+3 of each), B column c plane c % 2 of token c / 2 over the same
// elements, so C's column pair j is token j's (plane 0, plane 1) dots of rows g and g + 8. The K-quants scale each
// run apart: their mma is issued once per run with the other run's half of B zero; Q8_0 sums both runs in one. A
// unit's float contribution is then unit_expr.cuh's expression, the one matvec_q's units use, on the same fp32
// inputs computed without an int-to-float conversion: the mma adds each plane dot c (|c| < 2^22) to EXACT, whose
// bits as a float are 1.5 2^23 + c exactly; fmaf(256, c0, c1) then rounds 256 c0 + c1 once, as (float)(256 c0 + c1)
// does (exactly, where that is below 2^24: the K-quants' run dots, Q6_K's with its weights stored - 32 by the
// fragment so that the dot is dot - 32 s). matvec_q's (float)(sc dot) and (float)(m s) round an exact integer
// product once; here the same product of two exact floats, rounded once: the same bits.
//
// Staging. A kernel copies a unit's weights for its rows into shared memory as PIECES 16-byte pieces a (unit, row),
// [pieces][rows][16 bytes], and for Q6_K / Q8_0 (EXTRA) a word a (unit, row); frag() reads the lane's A words and
// scales from there. The pieces are found from the start b of the block holding the unit (a superblock of UNITS = 8
// units, or Q8_0's block) and the unit's place k in it: block_at() finds b in GGUF rows or, for Q4_K / Q6_K, in
// quant.cuh's tiled layout.
#pragma once

#include "act_quant.cuh"
#include "unit_expr.cuh"
#include "tensor_core.cuh"

namespace mu {

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
// Policy<T>: UNITS units in a block of BYTES bytes; PIECES 16-byte pieces (and with EXTRA a word) staged per (unit,
// row); piece_at(b, k, i) (ASYNC: 16-byte aligned in GGUF rows and the tiled layout, copied by cp.async) or
// piece(b, k, i) and extra(b, k) read them from the unit's block b; act(u, r): run r's activation half (2 group +
// half, mv::Unit<T>::runs); frag() the lane's A words of m-rows g and g + 8 and their scales (as exact floats) from
// the staged unit; unit() the unit's float contribution from its run dots (dots(), as floats) and the token's run
// scales (unit_expr.cuh).

template <int T> struct Policy;

// Q4_K / Q5_K: unit u = 16 bytes of qs, superblock u / 8, k = u % 8: low nibbles sub-block 2 (k / 2) (run 0), high
// nibbles 2 (k / 2) + 1 (run 1), elements 16 (k % 2) + i; Q5_K's fifth bits in qh[16 (k % 2) + i], bits k / 2 * 2
// and + 1.
template <int T>
struct PolicyK45 {
  static constexpr int UNITS = 8, BYTES = T == GGML_Q4_K ? 144 : 176, QS = T == GGML_Q4_K ? 16 : 48;
  static constexpr int PIECES = T == GGML_Q4_K ? 2 : 3;  // qs, header (d, dmin, scales) [, qh]
  static constexpr bool EXTRA = false, SPLIT = true, ASYNC = true;
  struct Scale { float d, dmin, sc[2], m[2]; };
  __device__ static int act(int u, int r) { return 2 * ((u >> 3) * 8 + ((u & 7) >> 1) * 2 + r) + (u & 1); }
  __device__ static const uint8_t* piece_at(const uint8_t* b, int k, int i) {
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
  static constexpr int UNITS = 8, BYTES = 210, PIECES = 2;  // ql, qh
  static constexpr bool EXTRA = true, SPLIT = true, ASYNC = false;
  struct Scale { float d, sc[2]; };
  __device__ static int act(int u, int r) { return 2 * ((u >> 3) * 8 + ((u & 7) >> 2) * 4 + ((u & 3) >> 1) + 2 * r) + (u & 1); }
  __device__ static uint4 piece(const uint8_t* b, int k, int i) {
    return load16_at2(i == 0 ? b + 16 * k : b + 128 + 32 * (k >> 2) + 16 * (k & 1));
  }
  __device__ static uint32_t extra(const uint8_t* b, int k) {
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
  static constexpr int UNITS = 1, BYTES = 34, PIECES = 2;  // weights 0-15, 16-31
  static constexpr bool EXTRA = true, SPLIT = false, ASYNC = false;
  struct Scale { float d; };
  __device__ static int act(int u, int r) { return 2 * u + r; }
  __device__ static uint4 piece(const uint8_t* b, int, int i) { return load16_at2(b + 2 + 16 * i); }
  __device__ static uint32_t extra(const uint8_t* b, int) { return __ldg(reinterpret_cast<const unsigned short*>(b)); }
  __device__ static void frag(uint32_t (&a)[4], Scale (&sc)[2], const uint8_t* unit, const uint32_t* x, int rows, int rl,
                              int, int j) {
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

// The block holding unit u of row `row` of a matrix at data (rows row_bytes apart, or for Q4_K / Q6_K with tiled
// set in quant.cuh's tiled layout), and u's place k in it.
template <int T>
__device__ __forceinline__ const uint8_t* block_at(const uint8_t* data, int row, int u, long long row_bytes, bool tiled) {
  using P = Policy<T>;
  if constexpr (T == GGML_Q4_K || T == GGML_Q6_K) {
    if (tiled) return data + tiled_offset<T>(row, u / P::UNITS, row_bytes);
  }
  return data + (long long)row * row_bytes + (long long)(u / P::UNITS) * P::BYTES;
}
template <int T> __device__ __forceinline__ int place(int u) { return u % Policy<T>::UNITS; }

// A compile-time flag for a generic lambda's argument (a kernel's loop with and without its per-tile tests).
template <bool B> struct Flag { static constexpr bool value = B; };

// The run dots of m-rows g (h = 0) and g + 8 (h = 1) of the lane's token: dot[h][r] = (float)(256 dot(q, x0) +
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

}  // namespace mu
