// L2 prefetch of a decode step's next weights, launched on a side branch of the step's graph (l2_prefetch.py):
// while the kernels before a mat-vec run (the one before it, attention, norms), the first bytes of its matrices
// are brought into the L2, so it starts on hits instead of waiting out DRAM latency with few loads in flight.
// Nothing waits on this kernel but the end of the graph: an earlier try that prefetched from extra CTAs of the
// chain's own small kernels made every step slower, since their completion (and the mat-vec's PDL wait behind it)
// took the prefetch's time (docs/performance.md).
//
// ranges: up to MAX_RANGES byte ranges [ptr, ptr + bytes), 16-byte aligned, bytes a multiple of 16, prefetched in
// order (range 0's first chunk first). mode 0: bulk prefetch (cp.async.bulk.prefetch.L2, sm_90; before sm_90
// the per-sector form), 16 KiB per instruction; 1: one prefetch.global.L2 per 32-byte sector; 2: the same
// with ::evict_last. Prefetch is a hint: no result, no fault on the bytes it names.

#include "quant.cuh"  // the fixed-width integer names

namespace pf {
constexpr int MAX_RANGES = 3;
struct Ranges {
  const uint8_t* ptr[MAX_RANGES];
  long long bytes[MAX_RANGES];
};
}  // namespace pf

extern "C" __global__ void l2_prefetch(const __grid_constant__ pf::Ranges r, int mode) {
  const long long stride = (long long)gridDim.x * blockDim.x;
  const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  for (int i = 0; i < pf::MAX_RANGES; ++i) {
    const uint8_t* p = r.ptr[i];
    const long long bytes = r.bytes[i];
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (mode == 0) {
      constexpr long long CHUNK = 16384;
      for (long long c = first; c * CHUNK < bytes; c += stride) {
        const long long at = c * CHUNK;
        const unsigned n = (unsigned)min(CHUNK, bytes - at);
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p + at), "r"(n) : "memory");
      }
      continue;
    }
#endif
    for (long long s = first; s * 32 < bytes; s += stride) {
      if (mode == 2) {
        asm volatile("prefetch.global.L2::evict_last [%0];" ::"l"(p + s * 32));
      } else {
        asm volatile("prefetch.global.L2 [%0];" ::"l"(p + s * 32));
      }
    }
  }
}
