// Weights into L2 ahead of the kernel that streams them. A decode step alternates mat-vecs, which keep DRAM busy,
// with norm / attention / SwiGLU kernels of a few microseconds that read almost nothing: during those DRAM idles.
// A kernel launched with a Prefetch runs pf.blocks extra CTAs after its own grid (blockIdx.x >= pf.first_block)
// that only ask L2 for the next mat-vec's first bytes, so that mat-vec starts on L2 hits instead of DRAM misses.
// Weights are immutable, so this is only a hint: it never changes a result.
//
// When: the extra CTAs wait for the previous kernel first (PDL, pdl.cuh) unless pf.early. The previous kernel is
// the mat-vec that streams its own weights through L2 and launched this one at its start: prefetching then would
// compete with it, and with ~50 MB of L2 the lines could be evicted by its later loads before they are read.
// How: sm_90's bulk prefetch (one instruction per 4 KiB chunk, the TMA unit issues the L2 requests), spread over
// the CTAs' threads; before sm_90 a prefetch per 128-byte line.
#pragma once
#include "pdl.cuh"

constexpr int PREFETCH_RANGES = 4;
constexpr long long PREFETCH_CHUNK = 4096;

struct Prefetch {
  const unsigned char* ptr[PREFETCH_RANGES];  // 16-byte aligned; unused ranges have bytes 0
  long long bytes[PREFETCH_RANGES];           // multiples of 16
  int first_block;                            // the launching kernel's own grid size
  int blocks;                                 // extra CTAs that prefetch (0: none, the struct all zeros)
  int early;                                  // 1: do not wait for the previous kernel
};

__device__ __forceinline__ void prefetch_l2(const unsigned char* p, long long bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"((unsigned)bytes) : "memory");
#else
  for (long long o = 0; o < bytes; o += 128) asm volatile("prefetch.global.L2 [%0];" ::"l"(p + o));
#endif
}

// True in the extra CTAs, after they have issued their share of the prefetch: the kernel returns at once.
__device__ __forceinline__ bool prefetch_cta(const Prefetch& pf) {
  if (pf.blocks == 0 || (int)blockIdx.x < pf.first_block) return false;
  if (!pf.early) pdl_wait();
  const long long thread = (long long)(blockIdx.x - pf.first_block) * blockDim.x + threadIdx.x;
  const long long threads = (long long)pf.blocks * blockDim.x;
#pragma unroll
  for (int r = 0; r < PREFETCH_RANGES; ++r) {
    const long long chunks = (pf.bytes[r] + PREFETCH_CHUNK - 1) / PREFETCH_CHUNK;
    for (long long c = thread; c < chunks; c += threads) {
      const long long at = c * PREFETCH_CHUNK;
      prefetch_l2(pf.ptr[r] + at, min(PREFETCH_CHUNK, pf.bytes[r] - at));
    }
  }
  return true;
}
