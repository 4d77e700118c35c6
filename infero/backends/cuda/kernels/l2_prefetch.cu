// The first bytes of every block's share of a decode step's gate + up into the L2 ahead of matvec_glu, off the
// step's chain (l2_prefetch.py): a side branch of the step's graph that runs while attention leaves the DRAM idle.
//
// a, b: gate and up, each `chunks` chunks `stride` bytes apart (matvec_glu's blocks' 32 rows); of each chunk of
// each the first `take` bytes, one bulk prefetch apiece (address and size multiples of 16). Thread p: chunk p / 2 of
// gate (p even) or of up (odd), so that both halves of a block's first tiles are asked for together, first blocks
// first. sm_90 and later (cp.async.bulk.prefetch); the launcher skips older GPUs, where the body compiles empty.

#include "quant.cuh"  // the fixed-width integer names

extern "C" __global__ void __launch_bounds__(32)
    l2_prefetch_chunks(const uint8_t* __restrict__ a, const uint8_t* __restrict__ b, long long stride,
                       unsigned take, int chunks) {
  const int p = blockIdx.x * blockDim.x + threadIdx.x;
  if (p >= 2 * chunks) return;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const uint8_t* at = (p & 1 ? b : a) + (p >> 1) * stride;
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(at), "r"(take) : "memory");
#endif
}
