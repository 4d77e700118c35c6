// Rotary position embedding of one element pair, shared by rotary_store_kv and qk_norm_rotary_store_kv
// (elementwise.cu) and the q/k/v mat-vec's epilogue (matvec.cu): all give the same bits, every operation an
// explicit _rn one (no FMA contraction can differ between the kernels).
#pragma once

namespace rope {

// cos and sin of the fp32 angle pos * inv_freq, times mscale.
__device__ __forceinline__ void cos_sin(int pos, float inv_freq, float mscale, float& c, float& s) {
  float sn, cs;
  sincosf(__fmul_rn((float)pos, inv_freq), &sn, &cs);
  c = __fmul_rn(cs, mscale);
  s = __fmul_rn(sn, mscale);
}

// A block's table of cos / sin for pairs 0 .. rope_half - 1 at position pos, then a barrier: the per-token
// kernels compute each angle once and every pair of every head reads it.
__device__ __forceinline__ void fill_table(int pos, const float* inv_freq, float mscale, int rope_half, float* cos_s,
                                           float* sin_s) {
  for (int i = threadIdx.x; i < rope_half; i += blockDim.x) cos_sin(pos, inv_freq[i], mscale, cos_s[i], sin_s[i]);
  __syncthreads();
}

// (a, b) <- (a c - b s, b c + a s).
__device__ __forceinline__ void rotate(float& a, float& b, float c, float s) {
  const float ra = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
  b = __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s));
  a = ra;
}

}  // namespace rope
