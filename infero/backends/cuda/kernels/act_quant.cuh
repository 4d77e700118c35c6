// The mat-vec's activation format, written by matvec_quantize_x and, fused, by the kernels whose output feeds a
// mat-vec (add_rms_norm, swiglu): each 32-element group of a row as two int8 planes, x ~ d0 q0 + d1 q1, where
// plane 0 is x itself (q0 = rint(x / d0), d0 = amax / 127, 0 where d0 = 0) and plane 1 the residual x - d0 q0
// quantized the same way (one plane alone costs ~1% per linear on real hidden states; see matvec.cu).
// Layout for an activation of n rows and `cols` columns: xq int8 [2, n, cols]; xs ActScale [2, n, cols / 32].
// A NaN or Inf input makes both of its group's d NaN, so the mat-vec's output is NaN rather than finite garbage.
// Every writer computes the same function of the same fp32 values: the result is bitwise the same whichever
// kernel quantized.
#pragma once

#include "quant.cuh"  // the fixed-width integer names

struct ActScale {
  float d;   // activation scale of a 32-element group
  int sums;  // sum of q over elements 0..15 (low 16 bits, signed) and 16..31 (high 16 bits, signed)
};

namespace aq {

// A group's 32 values lie V per lane in LANES = 32 / V consecutive lanes (the group's first lane at a multiple
// of LANES); all 32 lanes of the warp must call. Returns the group's d; q gets this lane's quantized values;
// sums (valid in the group's first lane) the half sums packed as in ActScale.
template <int V>
__device__ __forceinline__ float quantize_group(const float (&v)[V], int (&q)[V], int& sums) {
  constexpr int LANES = 32 / V;
  float amax = 0.f;
#pragma unroll
  for (int k = 0; k < V; ++k) amax = fmaxf(amax, fabsf(v[k]));
#pragma unroll
  for (int o = 1; o < LANES; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, o));
  const float d = __fdiv_rn(amax, 127.f);
  int sum = 0;
#pragma unroll
  for (int k = 0; k < V; ++k) {
    q[k] = d == 0.f ? 0 : __float2int_rn(__fdiv_rn(v[k], d));
    sum += q[k];
  }
#pragma unroll
  for (int o = 1; o < LANES / 2; o <<= 1) sum += __shfl_xor_sync(0xFFFFFFFFu, sum, o);  // this half's sum
  const int hi = __shfl_down_sync(0xFFFFFFFFu, sum, LANES / 2);
  sums = (sum & 0xFFFF) | (hi << 16);
  return d;
}

template <int V>
__device__ __forceinline__ void store_q(int8_t* p, const int (&q)[V]) {
  uint32_t w[V / 4];
#pragma unroll
  for (int i = 0; i < V / 4; ++i)
    w[i] = (uint32_t)(q[4 * i] & 0xFF) | ((uint32_t)(q[4 * i + 1] & 0xFF) << 8) |
           ((uint32_t)(q[4 * i + 2] & 0xFF) << 16) | ((uint32_t)(q[4 * i + 3] & 0xFF) << 24);
  if constexpr (V == 8) {
    *reinterpret_cast<uint2*>(p) = make_uint2(w[0], w[1]);
  } else {
    *reinterpret_cast<uint32_t*>(p) = w[0];
  }
}

// Quantize this lane's V values of element e0 (a multiple of V) of row `row` into both planes. live: whether
// the values exist (lanes past the row's end still take part in the shuffles, writing nothing).
template <int V>
__device__ __forceinline__ void quantize_store(const float (&v)[V], bool live, int8_t* __restrict__ xq,
                                               ActScale* __restrict__ xs, int n, int cols, int row, int e0) {
  constexpr int LANES = 32 / V;
  float probe = 0.f;  // NaN iff some input of the group is NaN or infinite
#pragma unroll
  for (int k = 0; k < V; ++k) probe = __fadd_rn(probe, __fmul_rn(v[k], 0.f));
#pragma unroll
  for (int o = 1; o < LANES; o <<= 1) probe = __fadd_rn(probe, __shfl_xor_sync(0xFFFFFFFFu, probe, o));
  int q0[V], q1[V], s0, s1;
  const float d0 = quantize_group<V>(v, q0, s0);
  float r[V];
#pragma unroll
  for (int k = 0; k < V; ++k) r[k] = __fmaf_rn(-d0, (float)q0[k], v[k]);  // exact x - d0 q0, rounded once
  const float d1 = quantize_group<V>(r, q1, s1);
  if (!live) return;
  const long long plane = (long long)n * cols;
  const long long at = (long long)row * cols + e0;
  store_q<V>(xq + at, q0);
  store_q<V>(xq + plane + at, q1);
  if (e0 % 32 == 0) {
    const long long g = at / 32, plane_groups = plane / 32;
    xs[g] = ActScale{__fadd_rn(d0, probe), s0};
    xs[plane_groups + g] = ActScale{__fadd_rn(d1, probe), s1};
  }
}

}  // namespace aq
