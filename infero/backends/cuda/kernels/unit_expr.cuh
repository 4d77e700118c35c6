// The fp32 expression of one mat-vec unit (32 elements: two 16-element runs), for the formats whose experts the
// tensor-core expert kernel takes (Q4_K, Q5_K, Q6_K, Q8_0, and Q5_0's shape). matvec_q's units (matvec.cu,
// mv::Unit<T>::dot) sum their runs' integers with __dp4a, moe_mma.cu's matvec_experts_mma with mma.sync; both hand
// the same fp32 values here (an integer product's correctly rounded float: (float)(a b) in matvec_q, a product of
// exact floats in matvec_experts_mma), so a unit's contribution is one expression whichever instruction summed its
// integers (batch invariance, docs/kernels.md). A run's dot is 256 dot(q, x0) + dot(q, x1) (act_quant.cuh's planes),
// ad[r] its activation group's D. Explicit _rn intrinsics: no FMA contraction can differ between the files.
#pragma once

namespace ue {

// Q4_K / Q5_K: run r's scdot[r] = (float)(sc dot) and ms[r] = (float)(m s), sc and m its sub-block's 6-bit scale and
// min, s its activation half's sum; d and dmin the superblock's.
__device__ __forceinline__ float k45(float d, float dmin, const float (&scdot)[2], const float (&ms)[2],
                                     const float (&ad)[2]) {
  float f[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) f[r] = __fmaf_rn(d, scdot[r], -__fmul_rn(dmin, ms[r]));
  return __fmaf_rn(ad[1], f[1], __fmul_rn(ad[0], f[0]));
}

// Q6_K: run r's i[r] = (float)(sc (dot - 32 s)), sc its 16-element sub-block's int8 scale (weights are stored + 32).
__device__ __forceinline__ float q6k(float d, const float (&i)[2], const float (&ad)[2]) {
  return __fmul_rn(d, __fmaf_rn(ad[1], i[1], __fmul_rn(ad[0], i[0])));
}

// Q5_0 / Q8_0: one scale d for the block, whose two runs share an activation group: i = (float) of their dots' sum
// (Q5_0's offset applied).
__device__ __forceinline__ float block32(float d, float ad, float i) { return __fmul_rn(__fmul_rn(d, ad), i); }

}  // namespace ue
