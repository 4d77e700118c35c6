// Order-free sums for batch invariance (docs/kernels.md, rule 2): a linear layer's output is the sum of its units'
// fp32 contributions, each rounded once onto a grid of 2^-32 and added as 64-bit integers. Integer addition is exact
// and associative, so a row's bits do not depend on how a kernel splits, orders or reduces its units: lanes, warps,
// blocks, tensor-core tiles and atomics all give the same result. A float accumulator would make the result a
// function of the summation order, which every kernel would then have to reproduce.
//
// Range: an output and every partial sum must stay below 2^31 in magnitude (linear-layer outputs are far inside it);
// a unit's contribution is rounded to 2.3e-10 absolute, below fp32's own rounding for any output above 4e-3.
// Non-finite contributions: the int64 sum cannot carry them, so a float `probe` does (fmaf(c, 0, probe) is NaN once
// any c is NaN or infinite, else a zero). Probes are combined in any order; only their NaN-ness is read.
#pragma once

namespace fx {

struct Sum {
  long long v;
  float probe;
};

__device__ __forceinline__ Sum zero() { return Sum{0ll, 0.f}; }

__device__ __forceinline__ long long to_fixed(float c) { return __float2ll_rn(__fmul_rn(c, 4294967296.f)); }

__device__ __forceinline__ void add(Sum& s, float c) {
  s.v += to_fixed(c);
  s.probe = __fmaf_rn(c, 0.f, s.probe);
}

__device__ __forceinline__ void add(Sum& s, const Sum& o) {
  s.v += o.v;
  s.probe = __fadd_rn(s.probe, o.probe);
}

// Lane sums combined across the warp (xor butterfly: every lane gets the total).
__device__ __forceinline__ void warp_sum(Sum& s) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    s.v += __shfl_xor_sync(0xFFFFFFFFu, s.v, off);
    s.probe = __fadd_rn(s.probe, __shfl_xor_sync(0xFFFFFFFFu, s.probe, off));
  }
}

// The sum as a float, rounded once; NaN where a contribution was not finite.
__device__ __forceinline__ float value(const Sum& s) {
  const float v = __fmul_rn(__ll2float_rn(s.v), 2.3283064365386963e-10f);  // 2^-32
  return s.probe != s.probe ? s.probe : v;
}

}  // namespace fx
