"""What code run once a launch costs when the GPU has not run it lately (GPU machine): the hypothesis behind the
in-kernel merges that measured slower than their work (docs/performance.md, "Next for batch 1"), priced directly.

    python scripts/bench_cold_code.py [--repeats 20]

A kernel of one block of 128 threads an SM runs a straight-line body of R dependent FFMAs (R instructions of 16
bytes; R = 0 measures the kernel's frame) and records, per block, its SM's clock at its first instruction and after
the body. Its body's time is measured in four conditions, each in a fresh sequence on one stream:
  warm:      right after the same kernel (its code in the SMs' instruction caches and in the L2)
  L2 cold:   after the same kernel, then a read of 512 MiB (the code's lines gone from the L2; the SMs' caches keep
             what the small read kernel does not displace)
  SM cold:   after the same kernel, then a kernel of 256 KiB of other code (the SMs' caches refilled; the L2 keeps
             the code)
  both cold: after the same kernel, the other code, then the read: what a decode step's launch meets, whose code
             last ran one layer (~57 us and ~133 MB of weights) earlier
and the same two kinds under load, while a kernel on another stream (one block an SM, beside the measured one)
streams 2 GiB from the DRAM as a decode step's mat-vecs do:
  warm, loaded:  right after the same kernel, both beside the stream
  cold, loaded:  after the same kernel and the other code, all beside the stream (which also evicts the L2)
Per condition the median over blocks and repeats of the body's cycles, in µs at the SMs' clock, and the cost of
cold over warm per KiB of code. The kernels live in this file: they are measurements, not part of the engine.
On the H200 (nineteenth session) cold code cost next to nothing: 64 KiB 8.38 -> 8.55 µs idle, 8.63 -> 8.87 loaded
(3-4 ns a KiB; 30-50 for a 1 KiB body), against the ~2-6 ns an instruction (~130-400 a KiB) the in-kernel merges'
cost would have needed: straight-line code streams in as fast as it runs.
"""

from __future__ import annotations

import argparse
import ctypes

import numpy as np

from infero.backends.cuda import compiler, driver, runtime
from infero.backends.cuda.tensor import empty

_P, _L, _F = ctypes.c_void_p, ctypes.c_longlong, ctypes.c_float
BODIES = (0, 64, 256, 1024, 4096)  # FFMAs in the measured body
OTHER = 16384  # FFMAs of the kernel that displaces the SMs' instruction caches (256 KiB of code)
FLUSH_BYTES = 512 << 20

SOURCE = r"""
template <int R, int SALT>
__global__ void __launch_bounds__(128) body(long long* __restrict__ out, float a, float* __restrict__ sink) {
  long long c0, g0;
  asm volatile("mov.u64 %0, %%clock64;" : "=l"(c0));
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(g0));
  float x = (float)threadIdx.x;
#pragma unroll
  for (int i = 0; i < R; ++i) x = fmaf(x, a, (float)(i * 7 + SALT) * 0.0009765625f);  // an immediate each
  long long c1, g1;
  asm volatile("mov.u64 %0, %%clock64;" : "=l"(c1));
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(g1));
  if (x == 1234.5f) sink[threadIdx.x] = x;  // keeps the chain; never true for these inputs
  if (threadIdx.x == 0) {
    long long* o = out + 4 * blockIdx.x;
    o[0] = c0; o[1] = c1; o[2] = g0; o[3] = g1;
  }
}

// The load: a grid of one block an SM (its shared memory keeps a second out) reading `words` 16-byte words.
// words: a power of two (the buffer, read round and round); total: the words read.
extern "C" __global__ void __launch_bounds__(256) hog(const uint4* __restrict__ data, long long words, long long total,
                                                      unsigned* __restrict__ sink) {
  extern __shared__ uint4 unused[];
  unsigned acc = 0;
  for (long long i = blockIdx.x * 256ll + threadIdx.x; i < total; i += (long long)gridDim.x * 256 * 4) {
    uint4 v[4];
#pragma unroll
    for (int k = 0; k < 4; ++k)
      asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v[k].x), "=r"(v[k].y), "=r"(v[k].z),
                   "=r"(v[k].w) : "l"(data + ((i + k * (long long)gridDim.x * 256) & (words - 1))));
#pragma unroll
    for (int k = 0; k < 4; ++k) acc ^= v[k].x ^ v[k].y ^ v[k].z ^ v[k].w;
  }
  if (acc == 0x12345678u) sink[0] = acc + unused[0].x;
}

extern "C" __global__ void __launch_bounds__(256) flush(const uint4* __restrict__ data, long long words,
                                                        unsigned* __restrict__ sink) {
  unsigned acc = 0;
  for (long long i = blockIdx.x * 256ll + threadIdx.x; i < words; i += (long long)gridDim.x * 256) {
    uint4 v;
    asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(data + i));
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x12345678u) sink[0] = acc;
}
"""

CONDITIONS = ("warm", "L2 cold", "SM cold", "both cold", "warm, loaded", "cold, loaded")
HOG_SHARED = 160 << 10  # the load's blocks: one an SM, with room beside for the measured kernel
HOG_BYTES = 2 << 30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    context, stream = runtime.context(), runtime.stream()
    sms = context.info.num_sms
    names = [f"body<{r}, 1>" for r in BODIES] + [f"body<{OTHER}, 2>"]
    compiled = compiler.compile_source(SOURCE, "bench_cold_code.cu", context.info.arch, names=names)
    module = driver.Module(compiled.cubin)
    bodies = {r: module.function(compiled.lowered[f"body<{r}, 1>"]) for r in BODIES}
    other = module.function(compiled.lowered[f"body<{OTHER}, 2>"])
    flush, hog = module.function("flush"), module.function("hog")
    driver.set_max_dynamic_shared(hog, HOG_SHARED)
    side = driver.Stream()
    out, sink = empty((sms, 4), np.int64), empty((256,), np.float32)
    data, flush_sink = empty((FLUSH_BYTES // 16, 4), np.uint32), empty((1,), np.uint32)
    driver.memset_d8(data.ptr, 0x5A, data.nbytes, stream)

    def run_body(fn):
        driver.launch(fn, (sms,), (128,), (out.ptr, 1.0001, sink.ptr), (_P, _F, _P), stream)

    def run_flush():
        driver.launch(flush, (4 * sms,), (256,), (data.ptr, FLUSH_BYTES // 16, flush_sink.ptr), (_P, _L, _P), stream)

    def measure(fn, condition: str) -> tuple[np.ndarray, np.ndarray]:
        loaded = condition.endswith("loaded")
        if loaded:  # ~0.5 ms at the DRAM's rate, far longer than what it runs beside
            args = (data.ptr, FLUSH_BYTES // 16, HOG_BYTES // 16, flush_sink.ptr)
            driver.launch(hog, (sms,), (256,), args, (_P, _L, _L, _P), side, HOG_SHARED)
            for _ in range(3):  # its blocks on every SM before the measurement
                run_body(bodies[0])
        run_body(fn)
        if condition in ("SM cold", "both cold", "cold, loaded"):
            run_body(other)
        if condition in ("L2 cold", "both cold"):
            run_flush()
        run_body(fn)
        stream.synchronize()
        side.synchronize()
        rows = out.to_host()
        return (rows[:, 1] - rows[:, 0]).astype(np.float64), (rows[:, 3] - rows[:, 2]).astype(np.float64)

    for fn in list(bodies.values()) + [other]:  # load every kernel once before any measurement
        run_body(fn)
    run_flush()
    stream.synchronize()
    cycles_per_ns = []
    results = {}
    for r, fn in bodies.items():
        for condition in CONDITIONS:
            samples = []
            for _ in range(args.repeats):
                cycles, ns = measure(fn, condition)
                samples.append(cycles)
                if r == BODIES[-1] and condition == "warm":
                    cycles_per_ns.append(np.median(cycles / np.maximum(ns, 1)))
            results[(r, condition)] = float(np.median(np.concatenate(samples)))
    ghz = float(np.median(cycles_per_ns))
    print(f"SM clock {ghz:.3f} GHz (cycles per global-timer ns of the warm {BODIES[-1]}-FFMA body)")
    columns = " | ".join(f"{c} µs" for c in CONDITIONS)
    print(f"| FFMAs | code KiB | {columns} | cold - warm, ns per KiB: idle / loaded |")
    print("|---" * (3 + len(CONDITIONS)) + "|")
    for r in BODIES:
        us = [results[(r, c)] / (1e3 * ghz) for c in CONDITIONS]
        kib = r * 16 / 1024
        idle, loaded = ((us[3] - us[0]) * 1e3 / kib, (us[5] - us[4]) * 1e3 / kib) if kib else (float("nan"),) * 2
        print(f"| {r} | {kib:.1f} | " + " | ".join(f"{v:.2f}" for v in us) + f" | {idle:.0f} / {loaded:.0f} |")


if __name__ == "__main__":
    main()
