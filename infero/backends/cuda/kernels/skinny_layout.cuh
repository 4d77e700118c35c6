// Where skinny_gemm.cu's activation layout keeps an element, for kernels that write it straight from their own
// output (add_rms_norm): x for the skinny GEMM of weight type T is fp16 [sb][word][tile][lane][8], lane (g, c)
// holding token 8 tile + g's columns Fmt<T>::column(c, word, high, p) as (p0, p2), (p1, p3) of the low half, then
// of the high half. Four consecutive columns 4 m .. 4 m + 3 (p = 0..3) always share one (word, c, high), so a
// writer with them as a float4 stores two 32-bit words. These invert skinny_gemm.cu's Fmt<T>::column; a GPU test
// (tests/cuda/test_skinny_gemm.py) compares the norm's layout with skinny_x_to_f16's.
#pragma once

#include "quant.cuh"
#include "tensor_core.cuh"

namespace skl {

// The 32-bit word index (into uint32 xa) of columns col .. col + 3's (p0, p2) pair; (p1, p3) is the next word.
// col % 4 == 0; type one of Q4_K, Q6_K, Q8_0.
__device__ __forceinline__ long long word_of(int type, int col, int token, int tiles) {
  int sb, w, c, h, words;
  if (type == GGML_Q8_0) {  // 128-column superblocks: column 32 c + 8 word + 4 high + p
    sb = col >> 7;
    const int in = col & 127;
    c = in >> 5, w = (in >> 3) & 3, h = (in >> 2) & 1, words = 4;
  } else if (type == GGML_Q6_K) {  // column 128 (word / 4) + 64 high + 16 c + 4 (word % 4) + p
    sb = col >> 8;
    const int in = col & 255;
    w = 4 * (in >> 7) + ((in >> 2) & 3), h = (in >> 6) & 1, c = (in >> 4) & 3, words = 8;
  } else {  // Q4_K: column 64 c + 32 high + 4 word + p
    sb = col >> 8;
    const int in = col & 255;
    c = in >> 6, h = (in >> 5) & 1, w = (in >> 2) & 7, words = 8;
  }
  const long long slot = (((long long)sb * words + w) * tiles + (token >> 3)) * 32 + (token & 7) * 4 + c;
  return slot * 4 + 2 * h;
}

// Columns col .. col + 3 of token's row, v, into xa (skinny_x_to_f16's rounding: to nearest, saturating).
__device__ __forceinline__ void store4(uint32_t* xa, int type, int col, int token, int tiles, float4 v) {
  const long long at = word_of(type, col, token, tiles);
  xa[at] = tc::pack_half2_sat(v.x, v.z);
  xa[at + 1] = tc::pack_half2_sat(v.y, v.w);
}

}  // namespace skl
