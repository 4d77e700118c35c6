// Programmatic dependent launch (sm_90+). Inside a captured CUDA graph the launchers start the forward pass's
// kernels with the programmatic-stream-serialization attribute, so a kernel's CTAs may be scheduled while the
// kernel before it in the stream is still finishing; each such kernel therefore calls pdl_wait() before it reads
// anything an earlier kernel wrote, and before it writes anything an earlier kernel may still read. What only
// reads data no kernel of this step writes may run before the wait, overlapping the previous kernel's tail: the
// mat-vecs stream their weights there, decode attention reads the batch metadata (uploaded before the graph runs)
// and loads the K/V of positions earlier steps wrote. pdl_wait() waits for the whole previous grid to complete
// with its memory visible; since every kernel launched this way waits (every CTA, also one that has nothing to
// do), completion is transitive down the stream. Before sm_90 (and for launches without the attribute) both calls
// are no-ops.
#pragma once

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Lets the next kernel's CTAs be scheduled once every CTA of this grid has called this (or exited).
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}

// The common case: wait for the previous kernel, then let the next one be scheduled. In this order a kernel's
// CTAs start only once the kernel two back has completed (if a CTA of the one between waited rather than exiting
// first), so before its wait a kernel could also read what that one and earlier ones wrote. Triggering before
// the wait (the next kernels' CTAs taking SMs and loading weights earlier still) measured slower on the H200:
// decode step 3,168 vs 2,912 us on llama-3.1-8b, 1,072 vs 1,008-1,036 on qwen2.5-0.5b (docs/performance.md).
__device__ __forceinline__ void pdl_enter() {
  pdl_wait();
  pdl_launch_dependents();
}
