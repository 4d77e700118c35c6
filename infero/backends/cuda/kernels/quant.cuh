// GGML weight encodings on the device: type ids, block sizes, and dequant8, the one decoder every kernel that
// reads GGUF weights shares (GEMM, embedding). The bit layouts follow the `gguf` package's numpy dequantizers
// (gguf/quants.py), and every value is computed with the same float32 operations in the same order
// (__fmul_rn/__fadd_rn, never contracted into an FMA), so dequant8 is bitwise equal to gguf.dequantize.
//
// Block layouts (byte offsets inside one block; fp16 = IEEE half, little endian):
//   Q4_0   32 el  18 B  d fp16 @0, qs[16] @2: element j<16 = low nibble of qs[j], j>=16 high nibble of qs[j-16];
//                       value d * (q - 8)
//   Q4_1   32 el  20 B  d @0, m @2, qs[16] @4 (nibbles as Q4_0); value d * q + m
//   Q5_0   32 el  22 B  d @0, qh u32 @2 (bit j = 5th bit of element j), qs[16] @6; value d * (q - 16)
//   Q5_1   32 el  24 B  d @0, m @2, qh @4, qs[16] @8; value d * q + m
//   Q8_0   32 el  34 B  d @0, qs int8[32] @2; value q * d
//   IQ4_NL 32 el  18 B  as Q4_0, value d * kvalues[q]
//   Q2_K  256 el  84 B  scales[16] @0 (lo nibble scale, hi nibble min, per 16 elements), qs[64] @16, d @80,
//                       dmin @82; element e: half h = e/128, shift s = (e%128)/32, l = e%32:
//                       q = (qs[32h + l] >> 2s) & 3; value (d*sc) * q - (dmin*m)
//   Q3_K  256 el 110 B  hmask[32] @0, qs[64] @32, scales[12] @96 (16 6-bit signed scales), d @108;
//                       q = ((qs[32h + l] >> 2s) & 3) - (hmask[l] bit (e/32) ? 0 : 4); value (d*sc) * q
//   Q4_K  256 el 144 B  d @0, dmin @2, scales[12] @4 (8 6-bit scales and mins), qs[128] @16: sub-block
//                       j = e/32 reads nibble j%2 of qs[32(j/2) + e%32]; value (d*sc_j) * q - (dmin*m_j)
//   Q5_K  256 el 176 B  d @0, dmin @2, scales[12] @4, qh[32] @16 (bit j of qh[e%32] = 5th bit), qs[128] @48
//   Q6_K  256 el 210 B  ql[128] @0, qh[64] @128, scales int8[16] @192, d @208; element e: h = e/128, r = e%128:
//                       q = (nibble r/64 of ql[64h + r%64]) | (((qh[32h + r%32] >> 2(r/32)) & 3) << 4);
//                       value (d*sc) * (q - 32)
//   IQ4_XS 256 el 136 B d @0, scales_h u16 @2, scales_l[4] @4, qs[128] @8: sub-block j = e/32 reads
//                       qs[16j + l%16] (l = e%32, nibble l/16); scale (lo4 | hi2 << 4) - 32; value (d*sc) * kv[q]
//   F32 / F16 / BF16    one element per "block"
//
// Alignment. A GGUF row is a run of whole blocks, so a block is aligned to BlockInfo<T>::ALIGN bytes (the
// largest power of two dividing BYTES, at most 16) when the tensor starts 16-byte aligned. dequant8 issues only
// 1-, 2- and 4-byte loads and needs `row` aligned to min(ALIGN, 4) bytes (F32: 4; F16, BF16: 2), which any copy
// that keeps the address modulo 4 (or 8, 16) preserves.

#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

// NVRTC has no <cstdint>; these are the fixed-width names every kernel file uses.
#ifndef INFERO_INT_TYPES
#define INFERO_INT_TYPES
typedef signed char int8_t;
typedef unsigned char uint8_t;
typedef short int16_t;
typedef unsigned short uint16_t;
typedef int int32_t;
typedef unsigned int uint32_t;
#endif

// GGML type ids (an enum: no storage in any module, usable as template arguments).
enum GgmlType : int {
  GGML_F32 = 0,
  GGML_F16 = 1,
  GGML_Q4_0 = 2,
  GGML_Q4_1 = 3,
  GGML_Q5_0 = 6,
  GGML_Q5_1 = 7,
  GGML_Q8_0 = 8,
  GGML_Q2_K = 10,
  GGML_Q3_K = 11,
  GGML_Q4_K = 12,
  GGML_Q5_K = 13,
  GGML_Q6_K = 14,
  GGML_IQ4_NL = 20,
  GGML_IQ4_XS = 23,
  GGML_BF16 = 30,
};

constexpr int block_align(int bytes) { return (bytes & 15) == 0 ? 16 : (bytes & 7) == 0 ? 8 : (bytes & 3) == 0 ? 4 : (bytes & 1) == 0 ? 2 : 1; }

template <int T> struct BlockInfo;
#define INFERO_BLOCK_INFO(T, E, B)                    \
  template <> struct BlockInfo<T> {                   \
    static constexpr int ELEMS = E;                   \
    static constexpr int BYTES = B;                   \
    static constexpr int ALIGN = block_align(B);      \
  };
INFERO_BLOCK_INFO(GGML_F32, 1, 4)
INFERO_BLOCK_INFO(GGML_F16, 1, 2)
INFERO_BLOCK_INFO(GGML_BF16, 1, 2)
INFERO_BLOCK_INFO(GGML_Q4_0, 32, 18)
INFERO_BLOCK_INFO(GGML_Q4_1, 32, 20)
INFERO_BLOCK_INFO(GGML_Q5_0, 32, 22)
INFERO_BLOCK_INFO(GGML_Q5_1, 32, 24)
INFERO_BLOCK_INFO(GGML_Q8_0, 32, 34)
INFERO_BLOCK_INFO(GGML_IQ4_NL, 32, 18)
INFERO_BLOCK_INFO(GGML_Q2_K, 256, 84)
INFERO_BLOCK_INFO(GGML_Q3_K, 256, 110)
INFERO_BLOCK_INFO(GGML_Q4_K, 256, 144)
INFERO_BLOCK_INFO(GGML_Q5_K, 256, 176)
INFERO_BLOCK_INFO(GGML_Q6_K, 256, 210)
INFERO_BLOCK_INFO(GGML_IQ4_XS, 256, 136)
#undef INFERO_BLOCK_INFO

// The tiled layout the decode mat-vecs stream fastest (matvec.cu's MmaCopy; cuda/weight_layout.py stores it), for
// Q4_K and Q6_K: each group of 8 rows as pair of superblocks after pair, [rows / 8][nsb / 2][8][2 slots], a slot a
// superblock (Q4_K: 144 bytes; Q6_K: 210 and 6 zero bytes, 216), for matrices of whole groups and an even count nsb
// of superblocks a row (row_bytes = nsb slots). Superblock sb of row `row` starts at tiled_offset<T>(row, sb,
// row_bytes), where the GGUF rows put it at row row_bytes + BlockInfo<T>::BYTES sb.
template <int T>
__device__ __forceinline__ long long tiled_offset(int row, int sb, long long row_bytes) {
  static_assert(T == GGML_Q4_K || T == GGML_Q6_K, "the tiled layout holds Q4_K and Q6_K");
  constexpr int SLOT = T == GGML_Q4_K ? 144 : 216;
  return (long long)(row & ~7) * row_bytes + (long long)(sb >> 1) * (16 * SLOT) + (row & 7) * (2 * SLOT) +
         (sb & 1) * SLOT;
}

namespace quant {

// ---- loads that respect a known alignment -------------------------------------------------------------------

__device__ __forceinline__ uint32_t ld_u16(const uint8_t* p) { return *reinterpret_cast<const uint16_t*>(p); }

__device__ __forceinline__ float ld_f16(const uint8_t* p) {
  return __half2float(__ushort_as_half(*reinterpret_cast<const unsigned short*>(p)));
}

// A little-endian 32-bit word at p, p aligned to ALIGN (2 or more).
template <int ALIGN>
__device__ __forceinline__ uint32_t ld_u32(const uint8_t* p) {
  if constexpr (ALIGN >= 4) {
    return *reinterpret_cast<const uint32_t*>(p);
  } else {
    const uint16_t* q = reinterpret_cast<const uint16_t*>(p);
    return (uint32_t)q[0] | ((uint32_t)q[1] << 16);
  }
}

// ---- IQ4 non-linear grid -----------------------------------------------------------------------------------

// kvalues = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113} as int8, 4 per word.
enum : uint32_t { IQ4_K0 = 0xBFAD9881u, IQ4_K1 = 0xF6EADDCFu, IQ4_K2 = 0x26190D01u, IQ4_K3 = 0x71594535u };

// idx holds four indices 0..15, one per byte; returns the four int8 kvalues in the same byte positions.
__device__ __forceinline__ uint32_t iq4_lookup4(uint32_t idx) {
  // Pack the indices as four nibbles (the selector form prmt reads), then pick from the low or high table
  // half by bit 3. Selector bit 3 is masked off everywhere: with it set prmt would replicate the sign.
  const uint32_t sel = __byte_perm(idx | (idx >> 4), 0, 0x0020) & 0xFFFFu;
  const uint32_t lo = __byte_perm(IQ4_K0, IQ4_K1, sel & 0x7777u);
  const uint32_t hi = __byte_perm(IQ4_K2, IQ4_K3, sel & 0x7777u);
  return __byte_perm(lo, hi, 0x3210u | ((sel >> 1) & 0x4444u));
}

__device__ __forceinline__ int byte_s8(uint32_t w, int i) { return (int)(int8_t)((w >> (8 * i)) & 0xFF); }

// ---- K-quant scale unpacking ---------------------------------------------------------------------------------

// Q4_K / Q5_K: scales and mins of sub-blocks 2c and 2c + 1 from a block's first 16 bytes h[0..3] (the 12 scale
// bytes are h[1..3]: s[j] = byte j % 4 of h[1 + j / 4]): for c < 2 the low 6 bits of s[j] (scale) and s[j + 4]
// (min); for c >= 2 the low / high nibble of s[j + 4] with the top 2 bits of s[j - 4] / s[j]. Both sub-blocks'
// bytes sit at 2 (c % 2) and the next of their words, so the selectors, shifts and masks depend on c alone: where
// c is fixed per lane (the mat-vec, the skinny GEMM), computed once.
__device__ __forceinline__ void k4_scales_mins(const uint32_t (&h)[4], int c, int (&sc)[2], int (&m)[2]) {
  const bool high = c >= 2;
  const int b = 2 * (c & 1);
  const uint32_t low_mask = high ? 0x0F0Fu : 0x3F3Fu, top_mask = high ? 0x3030u : 0u;
  const uint32_t sel = high ? (uint32_t)((4 + b) | ((5 + b) << 4)) : (uint32_t)(b | ((b + 1) << 4));
  const uint32_t scales = (__byte_perm(h[1], h[3], sel) & low_mask) | ((h[1] >> (8 * b + 2)) & top_mask);
  const uint32_t mins =
      ((__byte_perm(h[2], h[3], sel) >> (high ? 4 : 0)) & low_mask) | ((h[2] >> (8 * b + 2)) & top_mask);
  sc[0] = (int)(scales & 0xFFu);
  sc[1] = (int)(scales >> 8);
  m[0] = (int)(mins & 0xFFu);
  m[1] = (int)(mins >> 8);
}

// Q4_K / Q5_K: 6-bit scale and min of sub-block j (0..7) from the 12 scale bytes s.
__device__ __forceinline__ void k4_scale_min(const uint8_t* s, int j, int& sc, int& m) {
  if (j < 4) {
    sc = s[j] & 63;
    m = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// Q3_K: signed 6-bit scale j (0..15) from the 12 scale bytes s.
__device__ __forceinline__ int q3k_scale(const uint8_t* s, int j) {
  const int lo = j < 8 ? (s[j] & 0xF) : (s[j - 8] >> 4);
  const int hi = (s[8 + (j & 3)] >> (2 * (j >> 2))) & 3;
  return (lo | (hi << 4)) - 32;
}

// IQ4_XS: signed 6-bit scale of sub-block j (0..7); sh = scales_h, sl = scales_l bytes.
__device__ __forceinline__ int iq4xs_scale(uint32_t sh, const uint8_t* sl, int j) {
  const int lo = (sl[j >> 1] >> (4 * (j & 1))) & 0xF;
  const int hi = (sh >> (2 * j)) & 3;
  return (lo | (hi << 4)) - 32;
}

}  // namespace quant

// Decode elements [8g, 8g + 8) of a row (row = its first block, aligned to min(BlockInfo<T>::ALIGN, 4) bytes) into
// out, bitwise equal to gguf's dequantizer. The 8 elements never straddle a block or a 16-element sub-block.
// F32/F16/BF16 read 8 whole elements: a row whose length is not a multiple of 8 needs its tail decoded otherwise.
template <int T>
__device__ __forceinline__ void dequant8(const uint8_t* __restrict__ row, int g, float out[8]) {
  using namespace quant;
  constexpr int EL = BlockInfo<T>::ELEMS, BY = BlockInfo<T>::BYTES, AL = BlockInfo<T>::ALIGN;
  const int e0 = 8 * g;
  if constexpr (T == GGML_F32) {
    const float* p = reinterpret_cast<const float*>(row) + e0;
#pragma unroll
    for (int i = 0; i < 8; ++i) out[i] = p[i];
  } else if constexpr (T == GGML_F16) {
    const unsigned short* p = reinterpret_cast<const unsigned short*>(row) + e0;
#pragma unroll
    for (int i = 0; i < 8; ++i) out[i] = __half2float(__ushort_as_half(p[i]));
  } else if constexpr (T == GGML_BF16) {
    const unsigned short* p = reinterpret_cast<const unsigned short*>(row) + e0;
#pragma unroll
    for (int i = 0; i < 8; ++i) out[i] = __uint_as_float((uint32_t)p[i] << 16);
  } else {
    const uint8_t* blk = row + (e0 / EL) * BY;
    const int o = e0 % EL;  // first element inside the block
    if constexpr (T == GGML_Q4_0 || T == GGML_Q4_1 || T == GGML_IQ4_NL) {
      constexpr int QS = T == GGML_Q4_1 ? 4 : 2;
      const float d = ld_f16(blk);
      const uint32_t w0 = ld_u32<AL>(blk + QS + (o & 15)), w1 = ld_u32<AL>(blk + QS + (o & 15) + 4);
      const int shift = o >= 16 ? 4 : 0;
      const uint32_t n0 = (w0 >> shift) & 0x0F0F0F0Fu, n1 = (w1 >> shift) & 0x0F0F0F0Fu;
      if constexpr (T == GGML_Q4_0) {
#pragma unroll
        for (int i = 0; i < 8; ++i) out[i] = __fmul_rn(d, (float)((int)(((i < 4 ? n0 : n1) >> (8 * (i & 3))) & 0xF) - 8));
      } else if constexpr (T == GGML_Q4_1) {
        const float m = ld_f16(blk + 2);
#pragma unroll
        for (int i = 0; i < 8; ++i)
          out[i] = __fadd_rn(__fmul_rn(d, (float)(((i < 4 ? n0 : n1) >> (8 * (i & 3))) & 0xF)), m);
      } else {
        const uint32_t k0 = iq4_lookup4(n0), k1 = iq4_lookup4(n1);
#pragma unroll
        for (int i = 0; i < 8; ++i) out[i] = __fmul_rn(d, (float)byte_s8(i < 4 ? k0 : k1, i & 3));
      }
    } else if constexpr (T == GGML_Q5_0 || T == GGML_Q5_1) {
      constexpr int QH = T == GGML_Q5_0 ? 2 : 4, QS = QH + 4;
      const float d = ld_f16(blk);
      const uint32_t qh = ld_u32<(T == GGML_Q5_0 ? 2 : 4)>(blk + QH) >> o;
      const uint32_t w0 = ld_u32<AL>(blk + QS + (o & 15)), w1 = ld_u32<AL>(blk + QS + (o & 15) + 4);
      const int shift = o >= 16 ? 4 : 0;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int q = (int)((((i < 4 ? w0 : w1) >> (8 * (i & 3) + shift)) & 0xF) | (((qh >> i) & 1) << 4));
        if constexpr (T == GGML_Q5_0) {
          out[i] = __fmul_rn(d, (float)(q - 16));
        } else {
          out[i] = __fadd_rn(__fmul_rn(d, (float)q), ld_f16(blk + 2));
        }
      }
    } else if constexpr (T == GGML_Q8_0) {
      const float d = ld_f16(blk);
      const uint32_t w0 = ld_u32<AL>(blk + 2 + o), w1 = ld_u32<AL>(blk + 6 + o);
#pragma unroll
      for (int i = 0; i < 8; ++i) out[i] = __fmul_rn((float)byte_s8(i < 4 ? w0 : w1, i & 3), d);
    } else if constexpr (T == GGML_Q2_K) {
      const int h = o >> 7, s = (o >> 5) & 3, l = o & 31;
      const int sc = blk[o >> 4];
      const float dl = __fmul_rn(ld_f16(blk + 80), (float)(sc & 0xF));
      const float ml = __fmul_rn(ld_f16(blk + 82), (float)(sc >> 4));
      const uint32_t w0 = ld_u32<AL>(blk + 16 + 32 * h + l), w1 = ld_u32<AL>(blk + 20 + 32 * h + l);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int q = (int)(((i < 4 ? w0 : w1) >> (8 * (i & 3) + 2 * s)) & 3);
        out[i] = __fsub_rn(__fmul_rn(dl, (float)q), ml);
      }
    } else if constexpr (T == GGML_Q3_K) {
      const int h = o >> 7, s = (o >> 5) & 3, l = o & 31;
      const float dl = __fmul_rn(ld_f16(blk + 108), (float)q3k_scale(blk + 96, o >> 4));
      const uint32_t w0 = ld_u32<AL>(blk + 32 + 32 * h + l), w1 = ld_u32<AL>(blk + 36 + 32 * h + l);
      const uint32_t m0 = ld_u32<AL>(blk + l), m1 = ld_u32<AL>(blk + l + 4);
      const int hb = o >> 5;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int ql = (int)(((i < 4 ? w0 : w1) >> (8 * (i & 3) + 2 * s)) & 3);
        const int hbit = (int)(((i < 4 ? m0 : m1) >> (8 * (i & 3) + hb)) & 1);
        out[i] = __fmul_rn(dl, (float)(ql - (hbit ? 0 : 4)));
      }
    } else if constexpr (T == GGML_Q4_K || T == GGML_Q5_K) {
      const int j = o >> 5, l = o & 31;
      int sc, m;
      k4_scale_min(blk + 4, j, sc, m);
      const float dl = __fmul_rn(ld_f16(blk), (float)sc);
      const float ml = __fmul_rn(ld_f16(blk + 2), (float)m);
      constexpr int QS = T == GGML_Q4_K ? 16 : 48;
      const uint32_t w0 = ld_u32<AL>(blk + QS + 32 * (j >> 1) + l), w1 = ld_u32<AL>(blk + QS + 32 * (j >> 1) + l + 4);
      uint32_t h0 = 0, h1 = 0;
      if constexpr (T == GGML_Q5_K) {
        h0 = ld_u32<AL>(blk + 16 + l);
        h1 = ld_u32<AL>(blk + 20 + l);
      }
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        int q = (int)(((i < 4 ? w0 : w1) >> (8 * (i & 3) + 4 * (j & 1))) & 0xF);
        if constexpr (T == GGML_Q5_K) q |= (int)((((i < 4 ? h0 : h1) >> (8 * (i & 3) + j)) & 1) << 4);
        out[i] = __fsub_rn(__fmul_rn(dl, (float)q), ml);
      }
    } else if constexpr (T == GGML_Q6_K) {
      const int h = o >> 7, r = o & 127;
      const float dl = __fmul_rn(ld_f16(blk + 208), (float)(int8_t)blk[192 + (o >> 4)]);
      const uint32_t l0 = ld_u32<AL>(blk + 64 * h + (r & 63)), l1 = ld_u32<AL>(blk + 64 * h + (r & 63) + 4);
      const uint32_t q0 = ld_u32<AL>(blk + 128 + 32 * h + (r & 31)), q1 = ld_u32<AL>(blk + 132 + 32 * h + (r & 31));
      const int ls = 4 * (r >> 6), hs = 2 * (r >> 5);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int lo = (int)(((i < 4 ? l0 : l1) >> (8 * (i & 3) + ls)) & 0xF);
        const int hi = (int)(((i < 4 ? q0 : q1) >> (8 * (i & 3) + hs)) & 3);
        out[i] = __fmul_rn(dl, (float)((lo | (hi << 4)) - 32));
      }
    } else if constexpr (T == GGML_IQ4_XS) {
      const int j = o >> 5, l = o & 31;
      const float dl = __fmul_rn(ld_f16(blk), (float)iq4xs_scale(ld_u16(blk + 2), blk + 4, j));
      const int shift = 4 * (l >> 4);
      const uint32_t w0 = ld_u32<AL>(blk + 8 + 16 * j + (l & 15)), w1 = ld_u32<AL>(blk + 12 + 16 * j + (l & 15));
      const uint32_t k0 = iq4_lookup4((w0 >> shift) & 0x0F0F0F0Fu), k1 = iq4_lookup4((w1 >> shift) & 0x0F0F0F0Fu);
#pragma unroll
      for (int i = 0; i < 8; ++i) out[i] = __fmul_rn(dl, (float)byte_s8(i < 4 ? k0 : k1, i & 3));
    } else {
      static_assert(T < 0, "dequant8: unsupported GGML type");
    }
  }
}
