"""What a grid-wide barrier costs on this GPU, alone and between phases of a weight stream (GPU machine): the
numbers a persistent decode kernel (docs/performance.md, "Next for batch 1") stands on.

    python scripts/bench_grid_barrier.py [--ctas-per-sm 1,2,4] [--gib 4] [--ring 2,4,8,16]

1. A loop of barriers only: microseconds per barrier for a grid of every SM x k CTAs (all resident: a cooperative
   launch, which refuses a grid that could not be).
2. A buffer streamed in phases the size of a decode step's matrices (9.4 MB: the 8B's o projection; 33 MB: its
   gate; 66 MB: gate + up), each CTA reading a contiguous part of each phase, with no barrier between phases,
   a barrier, a barrier with the next phase's first loads issued before it (weights are immutable, so a
   persistent kernel can do that), or those loads issued between the barrier's arrival and its wait: TB/s of
   each ("no barrier" is the plain stream). Grids the kernel cannot hold resident are skipped.
3. The stream a persistent layer kernel would run (--ring): each warp's slice of each phase copied by `cp.async`
   into a ring of S stages in shared memory (1 KiB a warp a stage) that runs on across phases, so the next phase's
   first S - 1 stages are in flight while the CTA waits at the barrier; phases of one size as above, and the 8B
   layer's matrices in turn (q/k/v 14.2 MB, o 9.4, gate + up 66.1, down 33.0: "layer"); TB/s without and with the
   barriers, with the barrier's arrival by a warp that copies nothing, and with each phase's words handed out at
   run time (an atomic counter a phase) instead of fixed parts.
The kernels live in this file: they are measurements, not part of the engine.
"""

from __future__ import annotations

import argparse
import ctypes

import numpy as np
from cuda.bindings import driver as cu

from infero.backends.cuda import compiler, driver, runtime
from infero.backends.cuda.tensor import empty, from_host

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
// by: the thread that arrives and waits for the CTA.
__device__ __forceinline__ void grid_arrive(unsigned* counter, int by = 0) {
  __syncthreads();
  if (threadIdx.x == by) asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(counter) : "memory");
}
__device__ __forceinline__ void grid_wait(unsigned* counter, unsigned target, int by = 0) {
  if (threadIdx.x == by) {
    while (ld_acquire(counter) < target) {
    }
  }
  __syncthreads();
}
__device__ __forceinline__ void grid_barrier(unsigned* counter, unsigned target, int by = 0) {
  grid_arrive(counter, by);
  grid_wait(counter, target, by);
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

#define RING_PIECES 2  // 16-byte pieces a lane a stage: a stage is 1 KiB a warp

// A warp's copy of one stage: words [at, at + 32 RING_PIECES) into the stage at smem address `stage`, the words
// at or past `end` zero-filled.
__device__ __forceinline__ void ring_copy(unsigned stage, const uint4* data, long long at, long long end, int lane) {
#pragma unroll
  for (int u = 0; u < RING_PIECES; ++u) {
    const long long j = at + u * 32 + lane;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(stage + (u * 32 + lane) * 16),
                 "l"(data + (j < end ? j : 0)), "r"(j < end ? 16 : 0));
  }
}

// Once the stage has landed: refill the ring (issue), then fold the stage's words into acc.
template <int STAGES, class Issue>
__device__ __forceinline__ unsigned ring_consume(const uint4* stage, Issue&& issue, unsigned acc, int lane) {
  asm volatile("cp.async.wait_group %0;" ::"n"(STAGES - 2) : "memory");
  __syncwarp();
  issue();
  asm volatile("cp.async.commit_group;");
#pragma unroll
  for (int u = 0; u < RING_PIECES; ++u) {
    const uint4 v = stage[u * 32 + lane];
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  return acc;
}

// Phases [bounds[ph], bounds[ph + 1]) words, each CTA a contiguous part of each and each warp a contiguous part of
// its CTA's, streamed through the warp's ring of STAGES stages: the copies run on across phases (item after item,
// whatever phase it is in), the consumption stops at each phase's end for a grid barrier (barrier != 0; 2: the
// last warp copies nothing and its first thread arrives and waits, so the arrival's release has no copies of its
// own in flight).
template <int STAGES>
__global__ void __launch_bounds__(THREADS) ring_stream(const uint4* data, const long long* bounds, int phases,
                                                       int barrier, unsigned* counter, unsigned* sink) {
  extern __shared__ uint4 ring[];
  constexpr int WARPS = THREADS / 32, CHUNK = 32 * RING_PIECES;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, copiers = barrier == 2 ? WARPS - 1 : WARPS;
  const int by = barrier == 2 ? THREADS - 32 : 0;
  const unsigned mine = (unsigned)__cvta_generic_to_shared(ring + warp * STAGES * CHUNK);
  auto slice = [&](int ph, long long& lo, long long& hi) {
    const long long b = bounds[ph], words = bounds[ph + 1] - b;
    const long long part = (words + gridDim.x - 1) / gridDim.x, wpart = (part + copiers - 1) / copiers;
    const long long cta = (long long)blockIdx.x * part;
    lo = b + min(cta + warp * wpart, words);
    hi = b + min(min(cta + (warp + 1) * wpart, cta + part), words);
    if (hi < lo || warp >= copiers) hi = lo;
  };
  int iph = 0, issued = 0;  // the issuing cursor: phase, next word, end of the phase's slice
  long long inext, iend;
  slice(0, inext, iend);
  auto issue_next = [&]() {
    while (iph < phases && inext >= iend) {
      if (++iph < phases) slice(iph, inext, iend);
    }
    if (iph >= phases) return;
    ring_copy(mine + (unsigned)(issued++ % STAGES) * CHUNK * 16, data, inext, iend, lane);
    inext += CHUNK;
  };
#pragma unroll
  for (int i = 0; i < STAGES - 1; ++i) {
    issue_next();
    asm volatile("cp.async.commit_group;");
  }
  unsigned acc = 0;
  int item = 0;
  for (int ph = 0; ph < phases; ++ph) {
    long long lo, hi;
    slice(ph, lo, hi);
    const int chunks = (int)((hi - lo + CHUNK - 1) / CHUNK);
    for (int c = 0; c < chunks; ++c, ++item)
      acc = ring_consume<STAGES>(ring + (warp * STAGES + item % STAGES) * CHUNK, issue_next, acc, lane);
    if (barrier && ph + 1 < phases) grid_barrier(counter, (unsigned)(ph + 1) * gridDim.x, by);
  }
  if (acc == 0x9E3779B9u) sink[0] = acc;
}

// The same stream with each phase's words handed out at run time: a warp takes the next GRAB chunks of the phase
// from its counter (next[ph], an atomic), so warps that stream faster take more, and the barrier waits for the
// phase's last grab instead of for the slowest CTA's fixed part. A stage's phase is kept beside the ring (tags).
#define GRAB 16
template <int STAGES>
__global__ void __launch_bounds__(THREADS) ring_stream_dynamic(const uint4* data, const long long* bounds, int phases,
                                                               unsigned* next, unsigned* counter, unsigned* sink) {
  extern __shared__ uint4 ring[];
  constexpr int WARPS = THREADS / 32, CHUNK = 32 * RING_PIECES;
  __shared__ int tags[WARPS][STAGES];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const unsigned mine = (unsigned)__cvta_generic_to_shared(ring + warp * STAGES * CHUNK);
  int iph = 0, issued = 0;
  long long inext = 0, iend = 0;  // the current grab's words
  auto issue_next = [&]() {
    while (iph < phases && inext >= iend) {
      unsigned g = 0;
      if (lane == 0) g = atomicAdd(next + iph, 1u);
      g = __shfl_sync(0xFFFFFFFFu, g, 0);
      const long long start = bounds[iph] + (long long)g * GRAB * CHUNK;
      if (start < bounds[iph + 1]) {
        inext = start;
        iend = min(start + (long long)GRAB * CHUNK, bounds[iph + 1]);
      } else {
        ++iph;
      }
    }
    if (iph >= phases) return;
    if (lane == 0) tags[warp][issued % STAGES] = iph;
    ring_copy(mine + (unsigned)(issued++ % STAGES) * CHUNK * 16, data, inext, iend, lane);
    inext += CHUNK;
  };
#pragma unroll
  for (int i = 0; i < STAGES - 1; ++i) {
    issue_next();
    asm volatile("cp.async.commit_group;");
  }
  __syncwarp();
  unsigned acc = 0;
  int item = 0;
  for (int ph = 0; ph < phases; ++ph) {
    while (item < issued && tags[warp][item % STAGES] == ph) {
      acc = ring_consume<STAGES>(ring + (warp * STAGES + item % STAGES) * CHUNK, issue_next, acc, lane);
      ++item;
      __syncwarp();  // the tag just written by lane 0 is visible to the next check
    }
    if (ph + 1 < phases) grid_barrier(counter, (unsigned)(ph + 1) * gridDim.x);
  }
  if (acc == 0x9E3779B9u) sink[0] = acc;
}
"""

RING_STAGES = (2, 4, 8, 16)
LAYER_MB = (14.2, 9.4, 66.1, 33.0)  # the 8B layer's q/k/v, o, gate + up and down (Q4_K)


def compile_kernels():
    names = [f"ring_stream{d}<{s}>" for s in RING_STAGES for d in ("", "_dynamic")]
    compiled = compiler.compile_source(SOURCE, "bench_grid_barrier.cu", runtime.context().info.arch, names=names)
    module = driver.Module(compiled.cubin)
    rings = {(s, d): module.function(compiled.lowered[f"ring_stream{d}<{s}>"]) for s in RING_STAGES
             for d in ("", "_dynamic")}  # fmt: skip
    return module, module.function("barrier_loop"), module.function("phased_stream"), rings


def cooperative(fn, grid: int, args: tuple, types: tuple, stream, shared: int = 0) -> None:
    driver.check(cu.cuLaunchCooperativeKernel(fn, grid, 1, 1, THREADS, 1, 1, shared, stream.handle, (args, types)))


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
    parser.add_argument("--ring", help="only part 3, at these ring depths (of 2, 4, 8, 16)")
    args = parser.parse_args()
    stream, sms = runtime.stream(), runtime.context().info.num_sms
    _module, barrier_loop, phased_stream, rings = compile_kernels()
    counter, sink = empty((1,), np.uint32), empty((1,), np.uint32)
    total = int(args.gib * (1 << 30)) // (1 << 20) * (1 << 20)
    data = empty((total // 16, 4), np.uint32)
    driver.memset_d8(data.ptr, 0x5A, data.nbytes, stream)

    def reset():
        driver.memset_d8(counter.ptr, 0, 4, stream)

    if args.ring:
        ring_table(rings, [int(v) for v in args.ring.split(",")], args, stream, sms, total, data, counter, sink, reset)
        return
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


def ring_table(rings, depths, args, stream, sms, total, data, counter, sink, reset) -> None:
    """Part 3: TB/s of the ring stream without and with a grid barrier between phases, and with the barrier and
    each phase's words handed out at run time."""
    print(f"{'CTAs':>6} {'phases MB':>10} {'phases':>7} {'ring':>5} {'no barrier':>11} {'barrier':>9} "
          f"{'arrival apart':>14} {'+ handed out':>13}  TB/s")  # fmt: skip
    optin = runtime.context().info.max_shared_per_block_optin
    for k in (int(v) for v in args.ctas_per_sm.split(",")):
        grid = sms * k
        for sizes in [(9.4,), (33.0,), (66.0,), LAYER_MB]:
            words = [int(mb * 1e6) // 16 for mb in sizes]
            phases = total // 16 // sum(words) * len(sizes)
            bounds = np.cumsum([0] + [words[i % len(sizes)] for i in range(phases)]).astype(np.int64)
            bounds_dev = from_host(bounds)
            next_dev = empty((phases,), np.uint32)
            label = "layer" if len(sizes) > 1 else f"{sizes[0]:.1f}"
            for depth in depths:
                fn, dynamic = rings[(depth, "")], rings[(depth, "_dynamic")]
                shared = depth * THREADS // 32 * 32 * 2 * 16  # 1 KiB a warp a stage
                if shared > optin:
                    continue
                driver.set_max_dynamic_shared(fn, shared)
                driver.set_max_dynamic_shared(dynamic, shared)
                if min(driver.resident_blocks_per_sm(f, THREADS, shared) for f in (fn, dynamic)) < k:
                    print(f"{grid:>6} {label:>10} {phases:>7} {depth:>5} (not resident at {k} CTAs an SM)")
                    continue
                speeds = []
                variants = [(fn, (data.ptr, bounds_dev.ptr, phases, barrier, counter.ptr, sink.ptr), _I)
                            for barrier in (0, 1, 2)]  # fmt: skip
                variants.append((dynamic, (data.ptr, bounds_dev.ptr, phases, next_dev.ptr, counter.ptr, sink.ptr), _P))
                for f, launch_args, fourth in variants:

                    def run(f=f, launch_args=launch_args, fourth=fourth, shared=shared, grid=grid, next_dev=next_dev):
                        reset()
                        driver.memset_d8(next_dev.ptr, 0, next_dev.nbytes, stream)
                        cooperative(f, grid, launch_args, (_P, _P, _I, fourth, _P, _P), stream, shared)

                    speeds.append(int(bounds[-1]) * 16 / timed_us(run, stream) / 1e6)
                print(f"{grid:>6} {label:>10} {phases:>7} {depth:>5} {speeds[0]:>11.2f} {speeds[1]:>9.2f} "
                      f"{speeds[2]:>14.2f} {speeds[3]:>13.2f}")  # fmt: skip


def runtime_copy_tb_s(stream, nbytes: int = 1 << 30) -> float:
    src, dst = empty((nbytes,), np.uint8), empty((nbytes,), np.uint8)
    us = timed_us(lambda: driver.copy_device_to_device(dst.ptr, src.ptr, nbytes, stream), stream)
    return 2 * nbytes / us / 1e6


if __name__ == "__main__":
    main()
