// The linear-layer definition (unit_value.cuh) on the int8 tensor cores, shared by linear_mma.cu's linear_mma and
// moe_mma.cu's matvec_experts_mma. Types: Q4_K, Q5_K, Q6_K, Q8_0 (both); Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, IQ4_XS
// (linear_mma).
//
// A stage is a span: 256 columns, 8 units of 32, each aligned with one activation group. mma.m16n8k32 s8 x s8 takes
// a unit whole, its k order permuted (an integer sum does not depend on it): lane (g, j)'s k 4j..4j+3 are the unit's
// columns 8j..8j+3 and its k 16 + 4j.. columns 8j + 4.., so its two B words are 8 consecutive bytes of a column (one
// 64-bit load). The A fragment holds 16 rows x the unit's 32 integers w in that order, B column c plane c % 2 of
// token c / 2, so C's column pair j is token j's (I_0, I_1) of rows g and g + 8. One-run types take T from the raw
// int32 sums (t_of: |I| < 2^22, Q8_0's 32 x 127 x 127 the largest). Q6_K scales its 16-column runs apart: one mma a
// run (lanes j < 2 hold run 0's columns: each run's A fragment has the other lanes' words zero), each accumulator
// starting at EXACT so a sum lands as the bits of the float 1.5 2^23 + I, then I_p = S_1 I_p1 + S_0 I_p0 as floats
// (each product and the sum below 2^24: exact, unit_value.cuh's bound).
// A and B are formed once per (row, unit) and shared by the warp's token tiles (Q4_K / Q5_K: by prep(), when the
// stage lands, into [8][rows] float2s); D and M once per (token, unit) when the stage lands (scales()), shared by
// the rows. c = uv::value, the span's 8 units walked in column order by uv::span_step, each span's value fx::add-ed.
//
// Staging. A kernel copies each row's stage into shared memory as PIECES 16-byte pieces, [PIECES][rows][16 bytes]
// (lanes of one j read one word of rows g and g + 8: conflict free): piece_at() (ASYNC: the stage 16-byte aligned in
// GGUF rows and the tiled layout, copied by cp.async) or piece() for 2-byte aligned blocks, through registers from
// global memory (linear_mma) or from the stage's bytes copied whole into shared memory (matvec_experts_mma). The
// activation: [8 units][tokens][2 planes][32 bytes] and the scales [8][tokens][2 halves] (act_quant.cuh's ActScale),
// which scales() turns into {D, M} in the half-0 slot.
#pragma once

#include "act_quant.cuh"
#include "fixed_point.cuh"
#include "tensor_core.cuh"
#include "unit_value.cuh"

namespace mu {

constexpr int KU = 8;  // units a stage (a span)

__device__ __forceinline__ float f16_lo(uint32_t w) { return __half2float(__ushort_as_half((unsigned short)(w & 0xFFFFu))); }

// 16 bytes at a 2-byte aligned p from the 4-byte words holding them (the last one found from p's byte 15, so no
// word without a requested byte is read), shifted into place. GLOBAL: p is in global memory (read through the
// read-only cache), else in shared memory (a stage's bytes copied there whole: moe_mma.cu's raw windows).
template <bool GLOBAL = true>
__device__ __forceinline__ uint4 load16_at2(const uint8_t* p) {
  // Pointer arithmetic on p (not an integer made a pointer), so a shared-memory p is still known to be one: LDS.
  const int mis = (int)(reinterpret_cast<unsigned long long>(p) & 3);
  const uint32_t* w = reinterpret_cast<const uint32_t*>(p - mis);
  const uint32_t* last = reinterpret_cast<const uint32_t*>(p + 15 - ((mis + 15) & 3));
  uint32_t v[5];
#pragma unroll
  for (int i = 0; i < 4; ++i) v[i] = GLOBAL ? __ldg(w + i) : w[i];
  v[4] = GLOBAL ? __ldg(last) : *last;
  const int sh = 8 * mis;
  return make_uint4(__funnelshift_r(v[0], v[1], sh), __funnelshift_r(v[1], v[2], sh), __funnelshift_r(v[2], v[3], sh),
                    __funnelshift_r(v[3], v[4], sh));
}

__device__ __forceinline__ uint32_t word(const uint8_t* p) { return *reinterpret_cast<const uint32_t*>(p); }

constexpr int EXACT = 0x4B400000;  // 1.5 2^23 as a float's bits: an accumulator of EXACT leaves EXACT + I

// uv::value_t's T from a unit's two int32 sums (|I_p| < 2^22, so 256 I_0 + I_1 is exact in int32): its one
// conversion is the one rounding fmaf(256, I_0, I_1) makes of the same exact value, so the bits are uv::value's, in
// two instructions (an integer multiply-add and a conversion) where the exact floats of I_0, I_1 and an fmaf take 3.
__device__ __forceinline__ float t_of(int i0, int i1) { return __int2float_rn(256 * i0 + i1); }

// Word j of piece p of staged row r.
__device__ __forceinline__ uint32_t staged(const uint8_t* sw, int rows, int p, int r, int j) {
  return word(sw + 16 * (p * rows + r) + 4 * j);
}

// The 4 bytes at byte o (2-byte aligned) of staged row r; the second word only read where o is not 4-byte aligned
// (known at compile time in an unrolled unit loop), so none past the stage is.
__device__ __forceinline__ uint32_t staged_at(const uint8_t* sw, int rows, int r, int o) {
  const int a = o & ~3;
  const uint32_t lo = staged(sw, rows, a >> 4, r, (a >> 2) & 3);
  if ((o & 3) == 0) return lo;
  return __funnelshift_r(lo, staged(sw, rows, (a + 4) >> 4, r, ((a + 4) >> 2) & 3), 8 * (o & 3));
}

// ---- formats ------------------------------------------------------------------------------------------------------
// Policy<T>: a row's stage is PIECES 16-byte pieces from stage_at() (!ASYNC: piece(), from the stage_bytes()
// bytes of a 2-byte aligned stage); frag() the lane's A words (RUNS fragments) of
// rows rl and rl + 8 for unit k of the staged stage and their A, B (and Q6_K's run scales); mma() the unit's sums,
// value() its c for row h; HAS_M: M = s, the unit's activation sum (else B = M = 0); PREP: prep() forms a row's
// A, B of the stage's 8 units once, frag() reads them.

template <int T> struct Policy;

// Q4_K / Q5_K: a stage is one superblock (d, dmin, 12 bytes of scales [, qh 32], qs 128), staged whole. Unit k is
// sub-block k: qs bytes 32 (k / 2) .. + 31, low nibbles for even k, high for odd; Q5_K's fifth bit k of qh[i].
template <int T>
struct PolicyK45 {
  static constexpr int BYTES = T == GGML_Q4_K ? 144 : 176, PIECES = BYTES / 16, QS = T == GGML_Q4_K ? 1 : 3;
  static constexpr int RUNS = 1;
  static constexpr bool ASYNC = true, HAS_M = true, PREP = true;
  struct Unit { float2 ab[2]; };
  __device__ static const uint8_t* piece_at(const uint8_t* stage, int i) { return stage + 16 * i; }
  // Row r's {A, B} of units 2c and 2c + 1 into ab[k rows + r], from its header hd (the stage's first 16 bytes).
  __device__ static void prep_pair(float2* ab, uint4 hd, int rows, int r, int c) {
    const uint32_t w[4] = {hd.x, hd.y, hd.z, hd.w};
    const float d = f16_lo(hd.x), dmin = f16_lo(hd.x >> 16);
    int scale[2], min[2];
    quant::k4_scales_mins(w, c, scale, min);
#pragma unroll
    for (int e = 0; e < 2; ++e)  // fp16 x 6 bits: exact
      ab[(2 * c + e) * rows + r] = make_float2(__fmul_rn(d, (float)scale[e]), __fmul_rn(-dmin, (float)min[e]));
  }
  // Row r's {A, B} of units 0-7, from its staged header (piece 0).
  __device__ static void prep(float2* ab, const uint8_t* sw, int rows, int r) {
    const uint4 hd = *reinterpret_cast<const uint4*>(sw + 16 * r);
#pragma unroll
    for (int c = 0; c < 4; ++c) prep_pair(ab, hd, rows, r, c);
  }
  __device__ static void frag(uint32_t (&a)[RUNS][4], Unit& un, const uint8_t* sw, const float2* ab, int rows, int rl,
                              int k, int j) {
    const int c = k >> 1, nib = 4 * (k & 1), p = QS + 2 * c + (j >> 1), w = 2 * (j & 1);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = rl + 8 * h;
      a[0][h] = (staged(sw, rows, p, r, w) >> nib) & 0x0F0F0F0Fu;
      a[0][2 + h] = (staged(sw, rows, p, r, w + 1) >> nib) & 0x0F0F0F0Fu;
      if constexpr (T == GGML_Q5_K) {
        a[0][h] |= ((staged(sw, rows, 1 + (j >> 1), r, w) >> k) & 0x01010101u) << 4;
        a[0][2 + h] |= ((staged(sw, rows, 1 + (j >> 1), r, w + 1) >> k) & 0x01010101u) << 4;
      }
      un.ab[h] = ab[k * rows + r];
    }
  }
  __device__ static void mma(int (&c)[2][4], const uint32_t (&a)[RUNS][4], uint32_t b0, uint32_t b1) {
    tc::mma_16832_s8s8(c[0], a[0], b0, b1, 0);
  }
  __device__ static float value(const Unit& un, const int (&c)[2][4], int h, float2 dm) {
    return uv::value_t(dm.x, un.ab[h].x, un.ab[h].y, t_of(c[0][2 * h], c[0][2 * h + 1]), dm.y);
  }
};
template <> struct Policy<GGML_Q4_K> : PolicyK45<GGML_Q4_K> {};
template <> struct Policy<GGML_Q5_K> : PolicyK45<GGML_Q5_K> {};

// Q6_K: a stage is one superblock (ql 128, qh 64, scales 16, d), pieces 0-11 its bytes 0-191, 12 the scales, 13 d.
// Unit k (half hh = k / 4, m = k % 4): ql bytes 64 hh + 32 (m % 2) .. + 31, low nibbles for m < 2; their high bits
// in qh[32 hh + i], bits 2m, 2m + 1; run r's scale scales[2k + r]. w = q - 32.
template <>
struct Policy<GGML_Q6_K> {
  static constexpr int BYTES = 210, PIECES = 14, RUNS = 2;
  static constexpr bool ASYNC = false, HAS_M = false, PREP = false;
  __device__ static int stage_bytes(int) { return BYTES; }
  struct Unit { float a[2], s0[2], s1[2], k0[2], k1[2]; };  // k_r = -S_r 1.5 2^23: exact
  template <bool GLOBAL = true>
  __device__ static uint4 piece(const uint8_t* stage, int i, int = KU) {
    return i < 13 ? load16_at2<GLOBAL>(stage + 16 * i) : make_uint4(quant::ld_u16(stage + 208), 0u, 0u, 0u);
  }
  __device__ static void frag(uint32_t (&a)[RUNS][4], Unit& un, const uint8_t* sw, const float2*, int rows, int rl,
                              int k, int j) {
    const int hh = k >> 2, m = k & 3, ql = 4 * hh + 2 * (m & 1) + (j >> 1), nib = 4 * (m >> 1), w = 2 * (j & 1);
    const bool run0 = j < 2;  // columns 8j.. lie in run 0
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = rl + 8 * h;
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const uint32_t lo = (staged(sw, rows, ql, r, w + e) >> nib) & 0x0F0F0F0Fu;
        const uint32_t hi = ((staged(sw, rows, 8 + 2 * hh + (j >> 1), r, w + e) >> (2 * m)) & 0x03030303u) << 4;
        const uint32_t q = __vsub4(lo | hi, 0x20202020u);
        a[0][2 * e + h] = run0 ? q : 0u;
        a[1][2 * e + h] = run0 ? 0u : q;
      }
      const uint32_t sc = staged(sw, rows, 12, r, k >> 1) >> (16 * (k & 1));
      un.s0[h] = (float)(int)(int8_t)(sc & 0xFFu);
      un.s1[h] = (float)(int)(int8_t)((sc >> 8) & 0xFFu);
      un.k0[h] = __fmul_rn(un.s0[h], -12582912.f);
      un.k1[h] = __fmul_rn(un.s1[h], -12582912.f);
      un.a[h] = f16_lo(staged(sw, rows, 13, r, 0));
    }
  }
  __device__ static void mma(int (&c)[2][4], const uint32_t (&a)[RUNS][4], uint32_t b0, uint32_t b1) {
    tc::mma_16832_s8s8(c[0], a[0], b0, b1, EXACT);
    tc::mma_16832_s8s8(c[1], a[1], b0, b1, EXACT);
  }
  // S_r I_pr = fmaf(S_r, 1.5 2^23 + I_pr, k_r), exact, then their exact sum.
  __device__ static float value(const Unit& un, const int (&c)[2][4], int h, float2 dm) {
    float i[2];
#pragma unroll
    for (int p = 0; p < 2; ++p)
      i[p] = __fadd_rn(__fmaf_rn(un.s0[h], __int_as_float(c[0][2 * h + p]), un.k0[h]),
                       __fmaf_rn(un.s1[h], __int_as_float(c[1][2 * h + p]), un.k1[h]));
    return uv::value(dm.x, un.a[h], 0.f, i[0], i[1], 0.f);
  }
};

// Q8_0: a stage is 8 blocks (d, then 32 int8 weights); pieces 2k and 2k + 1 are block k's weights, piece 16 the
// 8 d's. Blocks past `valid` (a row's last, partial stage) read block valid - 1: their units are skipped.
template <>
struct Policy<GGML_Q8_0> {
  static constexpr int BYTES = 272, PIECES = 17, RUNS = 1;
  static constexpr bool ASYNC = false, HAS_M = false, PREP = false;
  __device__ static int stage_bytes(int valid) { return 34 * valid; }  // a row's last stage: `valid` blocks
  struct Unit { float a[2]; };
  template <bool GLOBAL = true>
  __device__ static uint4 piece(const uint8_t* stage, int i, int valid) {
    if (i < 16) return load16_at2<GLOBAL>(stage + 34 * min(i >> 1, valid - 1) + 2 + 16 * (i & 1));
    uint32_t d[4];
#pragma unroll
    for (int q = 0; q < 4; ++q)
      d[q] = quant::ld_u16(stage + 34 * min(2 * q, valid - 1)) |
             (quant::ld_u16(stage + 34 * min(2 * q + 1, valid - 1)) << 16);
    return make_uint4(d[0], d[1], d[2], d[3]);
  }
  __device__ static void frag(uint32_t (&a)[RUNS][4], Unit& un, const uint8_t* sw, const float2*, int rows, int rl,
                              int k, int j) {
    const int p = 2 * k + (j >> 1), w = 2 * (j & 1);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = rl + 8 * h;
      a[0][h] = staged(sw, rows, p, r, w);
      a[0][2 + h] = staged(sw, rows, p, r, w + 1);
      un.a[h] = f16_lo(staged(sw, rows, 16, r, k >> 1) >> (16 * (k & 1)));
    }
  }
  __device__ static void mma(int (&c)[2][4], const uint32_t (&a)[RUNS][4], uint32_t b0, uint32_t b1) {
    tc::mma_16832_s8s8(c[0], a[0], b0, b1, 0);
  }
  __device__ static float value(const Unit& un, const int (&c)[2][4], int h, float2 dm) {
    return uv::value_t(dm.x, un.a[h], 0.f, t_of(c[0][2 * h], c[0][2 * h + 1]), 0.f);
  }
};

// Q4_0 / Q4_1 / Q5_0 / Q5_1 / IQ4_NL: a stage is 8 blocks (d [, m] [, qh 4 bytes], qs 16), staged whole (144 / 160 /
// 176 / 192 / 144 bytes: 16-byte aligned in GGUF rows of a multiple of 256 columns). Unit k is block k: column i < 16
// the low nibble of qs[i], i >= 16 the high nibble of qs[i - 16]; Q5's fifth bit i of qh; IQ4_NL's w its kvalue.
// A = d, B = m or -8 d / -16 d (IQ4_NL: B = M = 0).
// Q4_0's and Q5_0's fields are 2-byte aligned: their words are put together from the two staged words around them.
template <int T>
struct Policy32 {
  static constexpr bool MIN = T == GGML_Q4_1 || T == GGML_Q5_1, FIVE = T == GGML_Q5_0 || T == GGML_Q5_1;
  static constexpr bool NL = T == GGML_IQ4_NL;
  static constexpr int BLOCK = 18 + (MIN ? 2 : 0) + (FIVE ? 4 : 0), QH = MIN ? 4 : 2, QS = QH + (FIVE ? 4 : 0);
  static constexpr int BYTES = 8 * BLOCK, PIECES = BYTES / 16, RUNS = 1;
  static constexpr bool ASYNC = true, HAS_M = !NL, PREP = false;
  struct Unit { float a[2], b[2]; };
  __device__ static const uint8_t* piece_at(const uint8_t* stage, int i) { return stage + 16 * i; }
  __device__ static uint32_t at(const uint8_t* sw, int rows, int r, int o) { return staged_at(sw, rows, r, o); }
  // Bit i of x's low 4 bits into bit 4 of byte i.
  __device__ static uint32_t spread4(uint32_t x) { return ((x & 0xFu) * 0x00204081u & 0x01010101u) << 4; }
  __device__ static void frag(uint32_t (&a)[RUNS][4], Unit& un, const uint8_t* sw, const float2*, int rows, int rl,
                              int k, int j) {
    const int o = BLOCK * k + QS + 8 * (j & 1), nib = 4 * (j >> 1);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = rl + 8 * h;
      a[0][h] = (at(sw, rows, r, o) >> nib) & 0x0F0F0F0Fu;
      a[0][2 + h] = (at(sw, rows, r, o + 4) >> nib) & 0x0F0F0F0Fu;
      if constexpr (FIVE) {
        const uint32_t qh = at(sw, rows, r, BLOCK * k + QH) >> (8 * j);
        a[0][h] |= spread4(qh);
        a[0][2 + h] |= spread4(qh >> 4);
      }
      if constexpr (NL) {
        a[0][h] = quant::iq4_lookup4(a[0][h]);
        a[0][2 + h] = quant::iq4_lookup4(a[0][2 + h]);
      }
      const uint32_t dm = at(sw, rows, r, BLOCK * k);
      un.a[h] = f16_lo(dm);
      un.b[h] = MIN ? f16_lo(dm >> 16) : __fmul_rn(un.a[h], NL ? 0.f : FIVE ? -16.f : -8.f);
    }
  }
  __device__ static void mma(int (&c)[2][4], const uint32_t (&a)[RUNS][4], uint32_t b0, uint32_t b1) {
    tc::mma_16832_s8s8(c[0], a[0], b0, b1, 0);
  }
  __device__ static float value(const Unit& un, const int (&c)[2][4], int h, float2 dm) {
    return uv::value_t(dm.x, un.a[h], NL ? 0.f : un.b[h], t_of(c[0][2 * h], c[0][2 * h + 1]), NL ? 0.f : dm.y);
  }
};
template <> struct Policy<GGML_Q4_0> : Policy32<GGML_Q4_0> {};
template <> struct Policy<GGML_IQ4_NL> : Policy32<GGML_IQ4_NL> {};
template <> struct Policy<GGML_Q4_1> : Policy32<GGML_Q4_1> {};
template <> struct Policy<GGML_Q5_0> : Policy32<GGML_Q5_0> {};
template <> struct Policy<GGML_Q5_1> : Policy32<GGML_Q5_1> {};

// IQ4_XS: a stage is one superblock (d, scales_h, scales_l[4], qs 128: 136 bytes, 8-byte aligned), pieces 0-7 its
// bytes 0-127, 8 the last 8. Unit k is sub-block k: column i < 16 the low nibble of qs[16k + i], i >= 16 the high
// nibble of qs[16k + i - 16], w its kvalue; A = d (ls - 32), B = M = 0.
template <>
struct Policy<GGML_IQ4_XS> {
  static constexpr int BYTES = 136, PIECES = 9, RUNS = 1;
  static constexpr bool ASYNC = false, HAS_M = false, PREP = false;
  __device__ static int stage_bytes(int) { return BYTES; }
  struct Unit { float a[2]; };
  template <bool GLOBAL = true>
  __device__ static uint4 piece(const uint8_t* stage, int i, int = KU) {
    if (i < 8) return load16_at2<GLOBAL>(stage + 16 * i);
    const uint2 v = *reinterpret_cast<const uint2*>(stage + 128);
    return make_uint4(v.x, v.y, 0u, 0u);
  }
  __device__ static void frag(uint32_t (&a)[RUNS][4], Unit& un, const uint8_t* sw, const float2*, int rows, int rl,
                              int k, int j) {
    const int o = 8 + 16 * k + 8 * (j & 1), nib = 4 * (j >> 1);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = rl + 8 * h;
      a[0][h] = quant::iq4_lookup4((staged_at(sw, rows, r, o) >> nib) & 0x0F0F0F0Fu);
      a[0][2 + h] = quant::iq4_lookup4((staged_at(sw, rows, r, o + 4) >> nib) & 0x0F0F0F0Fu);
      const uint32_t w0 = staged(sw, rows, 0, r, 0);
      un.a[h] = __fmul_rn(f16_lo(w0), (float)quant::iq4xs_scale(w0 >> 16, sw + 16 * r + 4, k));  // exact
    }
  }
  __device__ static void mma(int (&c)[2][4], const uint32_t (&a)[RUNS][4], uint32_t b0, uint32_t b1) {
    tc::mma_16832_s8s8(c[0], a[0], b0, b1, 0);
  }
  __device__ static float value(const Unit& un, const int (&c)[2][4], int h, float2 dm) {
    return uv::value_t(dm.x, un.a[h], 0.f, t_of(c[0][2 * h], c[0][2 * h + 1]), 0.f);
  }
};

// The start of stage st (columns 256 st ..) of row `row` of a matrix at data (rows row_bytes apart, or for Q4_K /
// Q6_K with tiled set in quant.cuh's tiled layout).
template <int T>
__device__ __forceinline__ const uint8_t* stage_at(const uint8_t* data, int row, int st, long long row_bytes,
                                                  bool tiled) {
  if constexpr (T == GGML_Q4_K || T == GGML_Q6_K) {
    if (tiled) return data + tiled_offset<T>(row, st, row_bytes);
  }
  return data + (long long)row * row_bytes + (long long)st * Policy<T>::BYTES;
}

// The staged scales of `count` (unit, token) pairs (index i: [unit][token], both halves' ActScale at 2 i, 2 i + 1)
// turned into {D, M} floats in the half-0 slot (M = s_0 + s_1: |M| < 2^24, exact), by the threads that copied them.
template <int T>
__device__ __forceinline__ void scales(ActScale* ss, int count, int tid, int threads) {
  if constexpr (Policy<T>::HAS_M) {
    for (int i = tid; i < count; i += threads) ss[2 * i].s = __float_as_int((float)(ss[2 * i].s + ss[2 * i + 1].s));
  }
}

// PREP types: rows [0, rows) of the staged stage's {A, B} formed into ab, each row by the thread that copied its
// header (piece 0: thread r of a block of at least `rows` threads).
template <int T>
__device__ __forceinline__ void prep(float2* ab, const uint8_t* sw, int rows, int tid) {
  if constexpr (Policy<T>::PREP) {
    if (tid < rows) Policy<T>::prep(ab, sw, rows, tid);
  }
}

// One span of a warp's 16 rows (rl, rl + 8) x the first LIVE of NT column tiles of 4 tokens from the staged stage:
// the weights sw ([PIECES][rows][16]) and their {A, B} ab (PREP types), the activation sb ([KU][tok][2][32]) and its
// {D, M} dm ([KU][tok] at 2 x); tile nt's tokens pb0 + 4 nt ..; units from `valid` on are absent (+0). Each
// output's span value is fx::add-ed to sum. LIVE and (in a whole stage) valid = KU are constants, so the unrolled
// units and tiles are straight-line code the compiler interleaves: a test between two mma chains (a run-time tile
// count or unit bound) had serialized each (unit, tile)'s loads, mma and arithmetic behind the last's.
template <int T, int NT, int LIVE>
__device__ __forceinline__ void span_tiles(fx::Sum (&sum)[NT][2], const uint8_t* sw, const float2* ab,
                                           const uint8_t* sb, const float2* dm, int rows, int tok, int rl, int pb0,
                                           int valid, int g, int j) {
  using P = Policy<T>;
  static_assert(LIVE >= 1 && LIVE <= NT, "1 to NT live tiles");
  float part[LIVE][2][3];
#pragma unroll
  for (int k = 0; k < KU; ++k) {
    const bool here = k < valid;
    uint32_t a[P::RUNS][4];
    typename P::Unit un;
    if (here) P::frag(a, un, sw, ab, rows, rl, k, j);
#pragma unroll
    for (int nt = 0; nt < LIVE; ++nt) {
      const int pb = pb0 + 4 * nt;
      float c[2] = {0.f, 0.f};
      if (here) {
        const uint2 bw = *reinterpret_cast<const uint2*>(sb + 64 * (k * tok + pb) + 32 * g + 8 * j);
        int acc[2][4];
        P::mma(acc, a, bw.x, bw.y);
        const float2 v = dm[2 * (k * tok + pb + j)];
#pragma unroll
        for (int h = 0; h < 2; ++h) c[h] = P::value(un, acc, h, v);
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) uv::span_step(part[nt][h], c[h], k);
    }
  }
#pragma unroll
  for (int nt = 0; nt < LIVE; ++nt)
#pragma unroll
    for (int h = 0; h < 2; ++h) fx::add(sum[nt][h], part[nt][h][0]);
}

// A compile-time int for a generic lambda's argument.
template <int N> struct Int { static constexpr int value = N; };

// f(Int<L>()) with L = tiles (1 .. NT) a constant: span_tiles' LIVE from a warp's run-time count of live tiles.
template <int NT, class F>
__device__ __forceinline__ void with_tiles(int tiles, F&& f) {
  if constexpr (NT > 1) {
    if (tiles < NT) return with_tiles<NT - 1>(tiles, f);
  }
  f(Int<NT>());
}

// span_tiles for a warp's run-time count of live tiles (1 .. NT) and a stage's `valid` units, both made constants
// where they can be: the live tiles always, `valid` = KU in a whole stage. PARTIAL: the type's rows may end inside a
// stage (valid < KU); for other types such a stage never occurs and has no code.
template <int T, int NT, bool PARTIAL>
__device__ __forceinline__ void span(fx::Sum (&sum)[NT][2], const uint8_t* sw, const float2* ab, const uint8_t* sb,
                                     const float2* dm, int rows, int tok, int rl, int pb0, int tiles, int valid,
                                     int g, int j) {
  with_tiles<NT>(tiles, [&](auto live) {
    constexpr int L = decltype(live)::value;
    if (valid == KU) {
      span_tiles<T, NT, L>(sum, sw, ab, sb, dm, rows, tok, rl, pb0, KU, g, j);
    } else if constexpr (PARTIAL) {
      span_tiles<T, NT, L>(sum, sw, ab, sb, dm, rows, tok, rl, pb0, valid, g, j);
    }
  });
}

}  // namespace mu
