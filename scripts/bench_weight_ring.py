"""A persistent mat-vec phase with its weights streamed through shared memory (GPU machine): the measurement a
persistent decode kernel needs first (docs/performance.md, "Next for batch 1").

    python scripts/bench_weight_ring.py [--stages 2,4,8] [--ctas-per-sm 1,2,3,4,6,8]

A grid of only resident CTAs; each warp walks row pairs w, w + W, ... of a Q4_K matrix at one token, as the
fused feed-forward launch of the eighth session did, but each lane streams its units' raw bytes (16 bytes of qs
and the block's 16-byte header, per row) through a ring of S stages in shared memory with cp.async, running on
across row-pair boundaries, instead of one unit ahead in registers. Its rows' sums are matvec_q's (same unit code,
order and butterfly), which the script checks bitwise, then times both in graphs over weight copies past the L2
(the plain launch as matvec.plan picks it, back to back with programmatic launch): weight TB/s of each.
"""

from __future__ import annotations

import argparse
import ctypes

import numpy as np
from bench_matvec import ARGS, launch_args, time_in_graph, weights_past_l2

from infero.backends.cuda import compiler, driver, matvec, runtime
from infero.backends.cuda.tensor import empty, from_host
from infero.checkpoint.synthetic import random_blocks
from infero.checkpoint.tensor_types import GGMLType

_P, _I, _L = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
THREADS = 128
Q4_K = int(GGMLType.Q4_K)
SHAPES = [(28672, 4096), (14336, 4096), (4096, 4096), (229376, 4096)]  # gate+up, gate, o of an 8B; steady

SOURCE = r"""
#include "matvec.cu"
#include "tensor_core.cuh"

// Q4_K rows of PER_LANE * 1024 columns (every lane has PER_LANE units in every row), one token.
template <int S, int MIN_BLOCKS, int PER_LANE>
__global__ void __launch_bounds__(128, MIN_BLOCKS)
    ring_q4k(const uint8_t* __restrict__ w, long long row_bytes, int rows, int cols, const int8_t* __restrict__ xq,
             const ActScale* __restrict__ xs, float* __restrict__ out) {
  using U = mv::Unit<GGML_Q4_K>;
  extern __shared__ uint4 smem[];  // [warps][S stages][2 rows][hd, qs][32 lanes]
  const int lane = threadIdx.x & 31, k = lane & 7, wib = threadIdx.x >> 5;
  const int warps = gridDim.x * (blockDim.x >> 5), warp = blockIdx.x * (blockDim.x >> 5) + wib;
  constexpr int per_lane = PER_LANE;
  const int tasks = (rows + 1) / 2;
  const int mine = tasks > warp ? (tasks - warp + warps - 1) / warps : 0;
  const int steps = mine * per_lane;  // this warp's (row pair, unit) positions
  uint4* ring = smem + wib * S * 4 * 32;
  auto slot = [&](int p, int r, int part) { return ring + (((p % S) * 2 + r) * 2 + part) * 32 + lane; };
  auto issue = [&](int p) {
    if (p < steps) {
      const int task = warp + (p / per_lane) * warps, u = lane + 32 * (p % per_lane);
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const uint8_t* b = w + (long long)min(2 * task + r, rows - 1) * row_bytes + (u >> 3) * 144;
        tc::cp_async<16>(slot(p, r, 0), b);
        tc::cp_async<16>(slot(p, r, 1), b + 16 + 16 * k);
      }
    }
    tc::cp_async_commit();  // one group per position, empty past the end, so the wait counts stay fixed
  };
#pragma unroll
  for (int p = 0; p < S - 1; ++p) issue(p);
  pdl_enter();  // as matvec_q: the first weights are on their way during the previous kernel's tail
  float acc[2][1] = {{0.f}, {0.f}};
  for (int p = 0; p < steps; ++p) {
    issue(p + S - 1);
    tc::cp_async_wait<S - 1>();
    const int i = p % per_lane, u = lane + 32 * i;
    typename U::W wv[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      typename U::Raw raw;
      const uint4 hd = *slot(p, r, 0), qs = *slot(p, r, 1);
      raw.hd.w[0] = hd.x; raw.hd.w[1] = hd.y; raw.hd.w[2] = hd.z; raw.hd.w[3] = hd.w;
      raw.qs.w[0] = qs.x; raw.qs.w[1] = qs.y; raw.qs.w[2] = qs.z; raw.qs.w[3] = qs.w;
      U::decode(wv[r], raw, nullptr, u, k);
    }
    int g[2], h[2];
    U::runs(u, k, g, h);
    mv::Act<2> a;
    mv::load_act(a, xq, xq + cols, xs, g, h);
#pragma unroll
    for (int r = 0; r < 2; ++r) acc[r][0] = __fadd_rn(acc[r][0], U::dot(wv[r], a));
    if (i == per_lane - 1) {
      mv::reduce_store<1, 2>(acc, out, nullptr, 1, rows, 2 * (warp + (p / per_lane) * warps), lane);
      acc[0][0] = acc[1][0] = 0.f;
    }
  }
}
"""
RING_ARGS = (_P, _L, _I, _I, _P, _P, _P)


def timed(stream, launches: list[tuple]) -> float:
    """Median microseconds per launch of these (function, grid, block, args, types, shared) launches, replayed
    back to back as one graph with programmatic launch."""

    def record():
        for fn, grid, block, values, types, shared in launches:
            driver.launch(fn, grid, block, values, types, stream, shared, pdl=True)

    return time_in_graph(stream, record, len(launches))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", default="2,4,8")
    parser.add_argument("--ctas-per-sm", default="1,2,3,4,6,8")
    args = parser.parse_args()
    stages = [int(s) for s in args.stages.split(",")]
    # Registers capped for as many resident CTAs as the shared memory allows (228 KiB an SM, S x 8 KiB a CTA).
    names = [f"ring_q4k<{s}, {min(8, 224 // (8 * s))}, 4>" for s in stages]  # the shapes' 4096 columns
    compiled = compiler.compile_source(SOURCE, "bench_weight_ring.cu", runtime.context().info.arch, names=names)
    module = driver.Module(compiled.cubin)
    stream, sms, rng = runtime.stream(), runtime.context().info.num_sms, np.random.default_rng(0)
    print(f"{'shape':>12} {'kernel':>22} {'us':>8} {'TB/s':>6}")
    for rows, cols in SHAPES:
        nbytes = rows * len(random_blocks(Q4_K, 1, cols, rng, 0.02)[0])
        ws = weights_past_l2(Q4_K, rows, cols, rng)
        x = from_host(rng.normal(0, 1, size=(1, cols)).astype(np.float32))
        q_shape, s_shape = matvec.activation_shapes(1, cols)
        xq, xs = empty(q_shape, np.int8), empty(s_shape, np.int32)
        matvec.quantize(xq, xs, x, stream)
        plain, ring = empty((1, rows), np.float32), empty((1, rows), np.float32)
        _, rpw, wpb, ahead = matvec.plan(rows, 1, sms, Q4_K, cols // 32)
        fn = runtime.kernel("matvec.cu", f"matvec_q<{Q4_K}, 1, {rpw}, {ahead}>")
        grid = (-(-rows // (rpw * wpb)),)
        us = timed(stream, [(fn, grid, (32 * wpb,), launch_args(plain, w, xq, xs, 1), ARGS, 0) for w in ws])
        shape = f"{rows:>6}x{cols:<5}"
        print(f"{shape} {f'matvec_q ({rpw}, {wpb}, {ahead})':>22} {us:8.2f} {nbytes / us / 1e6:6.2f}")
        expected = plain.to_host().view(np.uint32)
        for s, name in zip(stages, names, strict=True):
            kernel = module.function(compiled.lowered[name])
            shared = 4 * s * 4 * 32 * 16
            driver.set_max_dynamic_shared(kernel, shared)
            for per_sm in (int(c) for c in args.ctas_per_sm.split(",")):
                if driver.resident_blocks_per_sm(kernel, THREADS, shared) < per_sm:
                    continue
                launches = [(kernel, (per_sm * sms,), (THREADS,),
                             (w.data.ptr, w.data.shape[1], rows, cols, xq.ptr, xs.ptr, ring.ptr), RING_ARGS, shared)
                            for w in ws]  # fmt: skip
                us = timed(stream, launches)
                same = "" if np.array_equal(ring.to_host().view(np.uint32), expected) else "  DIFFERS from matvec_q"
                print(f"{shape} {f'ring S={s}, {per_sm}/SM':>22} {us:8.2f} {nbytes / us / 1e6:6.2f}{same}")


if __name__ == "__main__":
    main()
