// The numeric definition of a quantized linear layer (batch invariance rule 2, docs/kernels.md): matvec_q, the
// tensor-core mat-vecs (matvec_mma and its fused forms), the expert kernels (matvec.cu, moe_mma.cu) and the int8 GEMM
// (linear_mma.cu) compute each row as this, so a token's output has the same bits whatever kernel, width, tile or
// split produced it.
//
// Units. A row is cut into units of 32 consecutive columns, each aligned with one activation group (act_quant.cuh:
// x ~ D (256 q0 + q1) over the group, with the integer sums of 256 q0 + q1 over its two 16-element halves). For a
// unit and a token, from the weights' integers and the activation's planes:
//   I_p = sum over the unit's runs r of S_r * dot(w, q_p) over the run   (p = 0, 1: the planes; exact int32)
//   M   = the type's integer from the activation's half sums s_r          (exact int32)
// and from the block's scales two floats A and B (each an exact product: fp16 times a small integer). Per type
// (w the integers the dot products use; a run is 16 elements where the type scales 16, else the unit's 32):
//   Q4_0    w = q (0..15)        S = 1          A = d               B = -8 d        M = s
//   Q4_1    w = q (0..15)        S = 1          A = d               B = m           M = s
//   Q5_0    w = q (0..31)        S = 1          A = d               B = -16 d       M = s
//   Q5_1    w = q (0..31)        S = 1          A = d               B = m           M = s
//   Q8_0    w = q (int8)         S = 1          A = d               B = 0           M = 0
//   IQ4_NL  w = kvalues[q]       S = 1          A = d               B = 0           M = 0
//   IQ4_XS  w = kvalues[q]       S = 1          A = d (ls - 32)     B = 0           M = 0
//   Q4_K    w = q (0..15)        S = 1          A = d sc            B = -dmin m     M = s
//   Q5_K    w = q (0..31)        S = 1          A = d sc            B = -dmin m     M = s
//   Q6_K    w = q - 32 (-32..31) S_r = sc_r     A = d               B = 0           M = 0
//   Q3_K    w = q - 4 (-4..3)    S_r = sc_r-32  A = d               B = 0           M = 0
//   Q2_K    w = q (0..3)         S_r = sc_r     A = d               B = -dmin       M = sum_r m_r s_r
// (s: the unit's sum of 256 q0 + q1, s_r a run's; sc, m: the sub-block's scale and min as the format stores them;
// Q3_K's q is its two low bits plus 4 times its high bit.) |I_p| < 2^24 for every type (the largest, Q6_K's:
// 2 runs x 16 x 32 x 127 x 128 = 16,646,144) and |M| < 2^24 (Q2_K's: 2 x 15 x 16 x 32639), so (float)I_p and
// (float)M are exact. Q6_K and Q3_K take their offsets into w: with w = q, I_p reaches 2^25 and M 2^27.
// The unit's value:
//   c = D * (A * T + B * M),   T = 256 I_0 + I_1 rounded once   (value() below, explicit _rn: no contraction)
// Spans. The units of columns [256 k, 256 k + 256) form span k (a row's last span may hold fewer: absent units
// count +0). A span's value is the fixed tree ((c0 + c1) + (c2 + c3)) + ((c4 + c5) + (c6 + c7)) over its units in
// column order (span()): lanes holding units 8j .. 8j + 7 form it with xor shuffles 1, 2, 4, a thread walking them
// in order with three partials. The row is the fixed-point sum of its spans (fixed_point.cuh: fx::add of each span's
// value, in any order), then fx::value, then a deferred norm's factor (__fmul_rn), then the bias (__fadd_rn).
#pragma once

namespace uv {

// c = D (A T + B M) with T = 256 I0 + I1 rounded once by the caller (value() below, or one int32 -> float conversion
// of the exact integer 256 I0 + I1: the same single rounding of the same exact value).
__device__ __forceinline__ float value_t(float D, float A, float B, float t, float m) {
  return __fmul_rn(D, __fmaf_rn(A, t, __fmul_rn(B, m)));
}

// c = D (A T + B M), T = 256 I0 + I1: i0, i1 and m the exact floats of I_0, I_1 and M.
__device__ __forceinline__ float value(float D, float A, float B, float i0, float i1, float m) {
  return value_t(D, A, B, __fmaf_rn(256.f, i0, i1), m);
}

// A span's value from its eight unit values in column order.
__device__ __forceinline__ float span(const float (&c)[8]) {
  return __fadd_rn(__fadd_rn(__fadd_rn(c[0], c[1]), __fadd_rn(c[2], c[3])),
                   __fadd_rn(__fadd_rn(c[4], c[5]), __fadd_rn(c[6], c[7])));
}

// The same tree where each of 8 consecutive lanes (lane & 7 = the unit's place in its span) holds one unit's value:
// every one of the 8 gets the span's value. All 32 lanes must call.
__device__ __forceinline__ float span_of_lanes(float c) {
  c = __fadd_rn(c, __shfl_xor_sync(0xFFFFFFFFu, c, 1));
  c = __fadd_rn(c, __shfl_xor_sync(0xFFFFFFFFu, c, 2));
  return __fadd_rn(c, __shfl_xor_sync(0xFFFFFFFFu, c, 4));
}

// The same tree walked by one thread over a span's units in column order with three partials: span_step(p, c_k, k)
// for k = 0, ..., 7 (k a constant of an unrolled loop); after k = 7, p[0] is span()'s value.
__device__ __forceinline__ void span_step(float (&p)[3], float c, int k) {
  if (k == 0 || k == 2 || k == 4 || k == 6) {
    p[k == 0 ? 0 : k == 6 ? 2 : 1] = c;
  } else {
    const int i = k == 1 ? 0 : k == 7 ? 2 : 1;
    p[i] = __fadd_rn(p[i], c);
    if (k == 3) p[0] = __fadd_rn(p[0], p[1]);
    if (k == 7) {
      p[1] = __fadd_rn(p[1], p[2]);
      p[0] = __fadd_rn(p[0], p[1]);
    }
  }
}

}  // namespace uv
