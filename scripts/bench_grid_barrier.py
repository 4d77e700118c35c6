"""What a grid-wide barrier costs on this GPU, alone and between phases of a weight stream (GPU machine): the
numbers a persistent decode kernel (docs/performance.md, "Next for batch 1") stands on.

    python scripts/bench_grid_barrier.py [--ctas-per-sm 1,2,4] [--gib 4]

1. A loop of barriers only: microseconds per barrier for a grid of every SM x k CTAs (all resident: a cooperative
   launch, which refuses a grid that could not be).
2. A buffer streamed in phases the size of a decode step's matrices (9.4 MB: the 8B's o projection; 33 MB: its
   gate; 66 MB: gate + up), each CTA reading a contiguous part of each phase, with no barrier between phases,
   a barrier, a barrier with the next phase's first loads issued before it (weights are immutable, so a
   persistent kernel can do that), or those loads issued between the barrier's arrival and its wait: TB/s of
   each ("no barrier" is the plain stream). Grids the kernel cannot hold resident are skipped.
The kernels live in this file: they are measurements, not part of the engine.
"""

from __future__ import annotations

import argparse
import ctypes

import numpy as np
from cuda.bindings import driver as cu

from infero.backends.cuda import compiler, driver, runtime
from infero.backends.cuda.tensor import empty

_P, _I, _L = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong

THREADS = 256  # the kernels' block size (SOURCE's THREADS)

SOURCE = r"""
#define THREADS 256
#define UNROLL 8

__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Every CTA of the (co-resident) grid arrives, then waits until all have: round r of a kernel waits for the
// counter to reach (r + 1) gridDim.x. Split in two so that loads of immutable data can be issued between them:
// the arrival's release waits for the arriving thread's earlier loads, a wait does not.
__device__ __forceinline__ void grid_arrive(unsigned* counter) {
  __syncthreads();
  if (threadIdx.x == 0) asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(counter) : "memory");
}
__device__ __forceinline__ void grid_wait(unsigned* counter, unsigned target) {
  if (threadIdx.x == 0) {
    while (ld_acquire(counter) < target) {
    }
  }
  __syncthreads();
}
__device__ __forceinline__ void grid_barrier(unsigned* counter, unsigned target) {
  grid_arrive(counter);
  grid_wait(counter, target);
}

__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

extern "C" __global__ void __launch_bounds__(THREADS) barrier_loop(unsigned* counter, int rounds) {
  for (int r = 0; r < rounds; ++r) grid_barrier(counter, (unsigned)(r + 1) * gridDim.x);
}

// Loads of one round: UNROLL x THREADS words from `at`, XORed into acc (words past `end` read as zero).
__device__ __forceinline__ void load_round(const uint4* base, long long at, long long end, uint4 (&v)[UNROLL]) {
#pragma unroll
  for (int u = 0; u < UNROLL; ++u) {
    const long long j = at + u * THREADS + threadIdx.x;
    v[u] = j < end ? ld_stream(base + j) : make_uint4(0, 0, 0, 0);
  }
}
__device__ __forceinline__ unsigned fold(const uint4 (&v)[UNROLL], unsigned acc) {
#pragma unroll
  for (int u = 0; u < UNROLL; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  return acc;
}

// `phases` consecutive slices of phase_words words, each CTA a contiguous part of each. mode 0: no barrier
// between phases; 1: a grid barrier; 2: a grid barrier with the next phase's first round of loads issued before it;
// 3: the same loads issued between the barrier's arrival and its wait.
extern "C" __global__ void __launch_bounds__(THREADS) phased_stream(const uint4* data, long long phase_words,
                                                                   int phases, int mode, unsigned* counter,
                                                                   unsigned* sink) {
  const long long part = (phase_words + gridDim.x - 1) / gridDim.x;
  unsigned acc = 0;
  uint4 v[UNROLL];
  bool have_first = false;  // v holds this phase's first round already (mode 2)
  for (int ph = 0; ph < phases; ++ph) {
    const long long begin = blockIdx.x * part, end = min(begin + part, phase_words);
    const uint4* base = data + (long long)ph * phase_words;
    long long at = begin;
    if (!have_first) load_round(base, at, end, v);
    for (at += UNROLL * THREADS; at < end; at += UNROLL * THREADS) {
      uint4 next[UNROLL];
      load_round(base, at, end, next);
      acc = fold(v, acc);
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) v[u] = next[u];
    }
    acc = fold(v, acc);
    have_first = false;
    if (mode != 0 && ph + 1 < phases) {
      const long long next_begin = blockIdx.x * part;
      const uint4* next_base = data + (long long)(ph + 1) * phase_words;
      if (mode == 2) {
        load_round(next_base, next_begin, min(next_begin + part, phase_words), v);
        have_first = true;
      }
      grid_arrive(counter);
      if (mode == 3) {
        load_round(next_base, next_begin, min(next_begin + part, phase_words), v);
        have_first = true;
      }
      grid_wait(counter, (unsigned)(ph + 1) * gridDim.x);
    }
  }
  if (acc == 0x9E3779B9u) sink[0] = acc;  // keeps the loads; true with probability 2^-32
}
"""


def compile_kernels():
    compiled = compiler.compile_source(SOURCE, "bench_grid_barrier.cu", runtime.context().info.arch)
    module = driver.Module(compiled.cubin)
    return module, module.function("barrier_loop"), module.function("phased_stream")


def cooperative(fn, grid: int, args: tuple, types: tuple, stream) -> None:
    driver.check(cu.cuLaunchCooperativeKernel(fn, grid, 1, 1, THREADS, 1, 1, 0, stream.handle, (args, types)))


def timed_us(launch, stream, repeats: int = 5) -> float:
    start, end, times = driver.Event(), driver.Event(), []
    for _ in range(repeats + 1):
        start.record(stream)
        launch()
        end.record(stream)
        end.synchronize()
        times.append(end.elapsed_ms(start) * 1e3)
    return float(np.median(times[1:]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ctas-per-sm", default="1,2,4")
    parser.add_argument("--gib", type=float, default=4.0, help="bytes streamed per measurement")
    args = parser.parse_args()
    stream, sms = runtime.stream(), runtime.context().info.num_sms
    _module, barrier_loop, phased_stream = compile_kernels()
    counter, sink = empty((1,), np.uint32), empty((1,), np.uint32)
    total = int(args.gib * (1 << 30)) // (1 << 20) * (1 << 20)
    data = empty((total // 16, 4), np.uint32)
    driver.memset_d8(data.ptr, 0x5A, data.nbytes, stream)

    def reset():
        driver.memset_d8(counter.ptr, 0, 4, stream)

    print(f"{'CTAs':>6} {'barrier us':>11}")
    for k in (int(v) for v in args.ctas_per_sm.split(",")):
        grid = sms * k
        per_round = []
        for rounds in (0, 1000):

            def run(rounds=rounds, grid=grid):
                reset()
                cooperative(barrier_loop, grid, (counter.ptr, rounds), (_P, _I), stream)

            per_round.append(timed_us(run, stream))
        print(f"{grid:>6} {(per_round[1] - per_round[0]) / 1000:>11.2f}")

    print(f"\n{'CTAs':>6} {'phase MB':>9} {'phases':>7} {'no barrier':>11} {'barrier':>9} {'+ prefetch':>11} "
          f"{'arrive/load/wait':>17}  TB/s")  # fmt: skip
    resident = driver.resident_blocks_per_sm(phased_stream, THREADS)
    for k in (int(v) for v in args.ctas_per_sm.split(",")):
        if k > resident:  # a cooperative launch refuses a grid that cannot be resident at once
            print(f"{sms * k:>6} (phased_stream fits {resident} CTAs per SM)")
            continue
        grid = sms * k
        for phase_mb in (9.4, 33.0, 66.0):
            phase_words = int(phase_mb * 1e6) // 16 // grid * grid
            phases = total // 16 // phase_words
            nbytes = phases * phase_words * 16
            speeds = []
            for mode in (0, 1, 2, 3):

                def run(mode=mode, grid=grid, phase_words=phase_words, phases=phases):
                    reset()
                    cooperative(phased_stream, grid, (data.ptr, phase_words, phases, mode, counter.ptr, sink.ptr),
                                (_P, _L, _I, _I, _P, _P), stream)  # fmt: skip

                speeds.append(nbytes / timed_us(run, stream) / 1e6)
            print(f"{grid:>6} {phase_mb:>9.1f} {phases:>7} {speeds[0]:>11.2f} {speeds[1]:>9.2f} {speeds[2]:>11.2f} "
                  f"{speeds[3]:>17.2f}")  # fmt: skip
    print(f"\ndevice-to-device copy: {runtime_copy_tb_s(stream):.2f} TB/s read + written")


def runtime_copy_tb_s(stream, nbytes: int = 1 << 30) -> float:
    src, dst = empty((nbytes,), np.uint8), empty((nbytes,), np.uint8)
    us = timed_us(lambda: driver.copy_device_to_device(dst.ptr, src.ptr, nbytes, stream), stream)
    return 2 * nbytes / us / 1e6


if __name__ == "__main__":
    main()
