// The mat-vec's activation format, written by matvec_quantize_x and, fused, by the kernels whose output feeds a
// mat-vec (add_rms_norm, swiglu, decode attention). Each 32-element group of a row is x ~ D (256 q0 + q1) with two int8 planes:
//   d0 = amax / 127, q0 = rint(x / d0)                      (0 where d0 = 0)
//   D = d0 / 256,    q1 = clamp(rint((x - d0 q0) / D), +-127)  (the rounding residual, |x - d0 q0| <= d0 / 2)
// The residual plane's scale is a fixed fraction of the first's, so a mat-vec combines the planes in integers,
// 256 dot(w, q0) + dot(w, q1), and applies one scale per group: the second plane costs __dp4a work, not float
// work. One plane alone costs ~1% per linear on real hidden states (their outlier channels set amax); two leave
// ~D / sqrt(12) ~ 1e-5 of amax.
// Layout for an activation of n rows and `cols` columns: xq int8 [2, n, cols] (plane 0, then plane 1);
// xs ActScale [n, cols / 16]: one per 16-element half of a group, {D, the half's sum of 256 q0 + q1}.
// A NaN or Inf input makes its group's D NaN, so the mat-vec's output is NaN rather than finite garbage.
// Every writer computes the same function of the same fp32 values: the result is bitwise the same whichever
// kernel quantized.
#pragma once

#include "quant.cuh"  // the fixed-width integer names

struct ActScale {
  float d;  // D of the group
  int s;    // sum of 256 q0 + q1 over this half's 16 elements (|s| <= 16 * 32639)
};

namespace aq {

// The low bytes of four ints, a in the lowest.
__device__ __forceinline__ uint32_t pack4(int a, int b, int c, int d) {
  return __byte_perm(__byte_perm(a, b, 0x0040), __byte_perm(c, d, 0x0040), 0x5410);
}

// Quantize this lane's V values of element e0 (a multiple of V) of row `row`. A group's 32 values lie V per
// lane in LANES = 32 / V consecutive lanes (the group's first lane at a multiple of LANES); all 32 lanes of the
// warp must call. live: whether the values exist (lanes past the row's end take part in the shuffles, writing
// nothing).
template <int V>
__device__ __forceinline__ void quantize_store(const float (&v)[V], bool live, int8_t* __restrict__ xq,
                                               ActScale* __restrict__ xs, int n, int cols, int row, int e0) {
  constexpr int LANES = 32 / V;
  float probe = 0.f, amax = 0.f;  // probe: NaN iff some input of the group is NaN or infinite
#pragma unroll
  for (int k = 0; k < V; ++k) {
    probe = __fadd_rn(probe, __fmul_rn(v[k], 0.f));
    amax = fmaxf(amax, fabsf(v[k]));
  }
#pragma unroll
  for (int o = 1; o < LANES; o <<= 1) {
    probe = __fadd_rn(probe, __shfl_xor_sync(0xFFFFFFFFu, probe, o));
    amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, o));
  }
  const float d0 = __fdiv_rn(amax, 127.f), d = __fmul_rn(d0, 0.00390625f);
  int q0[V], q1[V], sum = 0;
#pragma unroll
  for (int k = 0; k < V; ++k) {
    q0[k] = d0 == 0.f ? 0 : __float2int_rn(__fdiv_rn(v[k], d0));
    const float r = __fmaf_rn(-d0, (float)q0[k], v[k]);  // exact x - d0 q0, rounded once
    q1[k] = d == 0.f ? 0 : max(-127, min(127, __float2int_rn(__fdiv_rn(r, d))));
    sum += 256 * q0[k] + q1[k];
  }
#pragma unroll
  for (int o = 1; o < LANES / 2; o <<= 1) sum += __shfl_xor_sync(0xFFFFFFFFu, sum, o);  // this half's sum
  if (!live) return;
  const long long at = (long long)row * cols + e0;
  int8_t* p0 = xq + at;
  int8_t* p1 = xq + (long long)n * cols + at;
  if constexpr (V == 1) {
    *p0 = (int8_t)q0[0];
    *p1 = (int8_t)q1[0];
  } else {
    uint32_t w0[V / 4], w1[V / 4];
#pragma unroll
    for (int i = 0; i < V / 4; ++i) {
      w0[i] = pack4(q0[4 * i], q0[4 * i + 1], q0[4 * i + 2], q0[4 * i + 3]);
      w1[i] = pack4(q1[4 * i], q1[4 * i + 1], q1[4 * i + 2], q1[4 * i + 3]);
    }
    if constexpr (V == 8) {
      *reinterpret_cast<uint2*>(p0) = make_uint2(w0[0], w0[1]);
      *reinterpret_cast<uint2*>(p1) = make_uint2(w1[0], w1[1]);
    } else {
      *reinterpret_cast<uint32_t*>(p0) = w0[0];
      *reinterpret_cast<uint32_t*>(p1) = w1[0];
    }
  }
  if (e0 % 16 == 0) xs[at / 16] = ActScale{__fadd_rn(d, probe), sum};
}

}  // namespace aq
