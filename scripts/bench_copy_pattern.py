"""Whether the weights' layout holds back the decode mat-vec's copies (GPU machine): gate + up's weight stream alone.

    python scripts/bench_copy_pattern.py

matvec_mma_glu's copies of llama-3.1-8b's gate + up (two 14336 x 4096 Q4_K matrices, 66 MB), nothing else: 448
blocks of 4 warps, each warp streaming its pairs of superblocks through a cp.async ring in shared memory and folding
each stage's bytes into a checksum, in one wave as the kernel runs. A stage is what MmaCopy copies: a pair of
superblocks (288 bytes) of 16 rows, the rows 2,304 bytes apart in the GGUF layout ("rows"); or the same 4,608 bytes
contiguous, as a layout with each tile's pairs stored together would hold them ("tiled"). Launches back to back in a
graph with PDL over copies of the weights past the L2 (bench_matvec.time_in_graph), median of 7; microseconds per
launch and TB/s, at 2 and 3 stages a warp. For scale: the whole kernel takes ~25.4 µs in the same setting, its copies
alone ~23.9 (docs/performance.md, "Gate + up taken apart"). Then the same for the 8B's down projections (4096 x
14336, Q4_K and Q6_K) as matvec_mma_norm copies them: TB/s of the GGUF rows' bytes.
The kernel lives in this file: a measurement, not part of the engine.
"""

from __future__ import annotations

import ctypes

import numpy as np
from bench_matvec import time_in_graph

from infero.backends.cuda import compiler, driver, runtime
from infero.backends.cuda.tensor import empty

ROWS, COLS = 14336, 4096
ROW_BYTES = COLS // 256 * 144  # Q4_K
STAGE = 16 * 288  # MmaQ4K::ROW: a stage's 16 rows of one superblock pair
STAGES = (2, 3)
COPIES = 2  # of gate + up, 132 MB: past the L2
_P, _L, _I = ctypes.c_void_p, ctypes.c_longlong, ctypes.c_int

SOURCE = r"""
#include "pdl.cuh"
#include "quant.cuh"  // the fixed-width integer names
#include "tensor_core.cuh"

// Block b: tile q (0-3) is gate rows 32 b + 8 q .. + 7 (m-rows 0-7) and the same up rows (m-rows 8-15); warp w takes
// pairs w, w + 4, ... of tile 0, then of tile 1, ... (matvec_mma_glu's order). TILED: tile (b, q)'s pair p is the
// 4,608 bytes at ((4 b + q) pairs + p) 4608 from gate (gate and up one buffer): the same bytes, each stage one
// contiguous piece.
template <int STAGES, bool TILED>
__global__ void __launch_bounds__(128) glu_copies(const uint8_t* gate, const uint8_t* up, long long row_bytes,
                                                  int pairs, unsigned* sink) {
  extern __shared__ uint4 ring[];
  constexpr int STAGE = 16 * 288, PIECES = STAGE / 16, SLOTS = PIECES / 32;  // 288 pieces: 9 a lane
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int count = (pairs - warp + 3) / 4, items = 4 * count;
  uint4* mine = ring + warp * STAGES * PIECES;
  long long off[SLOTS];  // a slot's piece: bytes past the tile's pair 0 (rows) or past the stage (tiled)
  int half[SLOTS];
#pragma unroll
  for (int i = 0; i < SLOTS; ++i) {
    const int piece = lane + 32 * i, r = piece / 18, o = piece % 18;
    half[i] = r >= 8;
    off[i] = TILED ? 16LL * piece : (long long)(r & 7) * row_bytes + 16 * o;
  }
  auto issue = [&](int item) {
    const int q = item / count, p = warp + 4 * (item % count);
    const unsigned stage = tc::smem_addr(mine + (item % STAGES) * PIECES) + 16 * lane;
#pragma unroll
    for (int i = 0; i < SLOTS; ++i) {
      const uint8_t* src;
      if constexpr (TILED)
        src = gate + ((long long)(4 * blockIdx.x + q) * pairs + p) * STAGE + off[i];
      else
        src = (half[i] ? up : gate) + (long long)(32 * blockIdx.x + 8 * q) * row_bytes + 288LL * p + off[i];
      tc::cp_async_16(stage + 512 * i, src, true);
    }
  };
#pragma unroll
  for (int i = 0; i < STAGES - 1; ++i) {
    if (i < items) issue(i);
    tc::cp_async_commit();
  }
  pdl_enter();
  unsigned acc = 0;
  for (int item = 0; item < items; ++item) {
    tc::cp_async_wait<STAGES - 2>();
    __syncwarp();
    if (item + STAGES - 1 < items) issue(item + STAGES - 1);
    tc::cp_async_commit();
    const uint4* s = mine + (item % STAGES) * PIECES;
#pragma unroll
    for (int i = 0; i < SLOTS; ++i) {
      const uint4 v = s[lane + 32 * i];
      acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
  }
  if (acc == 0x9E3779B9u) sink[0] = acc;  // keeps the copies; true with probability 2^-32
}

// matvec_mma_norm's copies (a down projection): block b is tiles 2 b and 2 b + 1 (16 rows each) of W warps, warp wi
// of a tile streaming pairs [wi pairs / W, (wi + 1) pairs / W). A stage: PIECES 16-byte pieces of each of the 16
// rows, from byte AT(p) of the row (Q4_K: 288 p, 18 pieces; Q6_K: 420 p rounded down to 16, 27 pieces); TILED: the
// tile's pair p as 16 PIECES contiguous pieces at (tile pairs + p) 16 PIECES 16.
template <int STAGES, bool TILED, int PIECES, int PAIR, int W>
__global__ void __launch_bounds__(64 * W) norm_copies(const uint8_t* weight, long long row_bytes, int pairs,
                                                      unsigned* sink) {
  extern __shared__ uint4 ring[];
  constexpr int STAGE = 16 * PIECES, SLOTS = (STAGE + 31) / 32;  // pieces a stage, a lane's
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, half = warp / W, wi = warp % W;
  const int tile = 2 * blockIdx.x + half, p0 = wi * pairs / W, count = (wi + 1) * pairs / W - p0;
  uint4* mine = ring + warp * STAGES * STAGE;
  long long off[SLOTS];
#pragma unroll
  for (int i = 0; i < SLOTS; ++i) {
    const int piece = min(lane + 32 * i, STAGE - 1);
    off[i] = TILED ? 16LL * piece : (long long)(piece / PIECES) * row_bytes + 16 * (piece % PIECES);
  }
  auto issue = [&](int item) {
    const int p = p0 + item;
    const uint8_t* at = TILED ? weight + ((long long)tile * pairs + p) * STAGE * 16
                              : weight + (long long)16 * tile * row_bytes + (((long long)PAIR * p) & ~15LL);
    const unsigned stage = tc::smem_addr(mine + (item % STAGES) * STAGE) + 16 * lane;
#pragma unroll
    for (int i = 0; i < SLOTS; ++i)
      if (lane + 32 * i < STAGE) tc::cp_async_16(stage + 512 * i, at + off[i], true);
  };
#pragma unroll
  for (int i = 0; i < STAGES - 1; ++i) {
    if (i < count) issue(i);
    tc::cp_async_commit();
  }
  pdl_enter();
  unsigned acc = 0;
  for (int item = 0; item < count; ++item) {
    tc::cp_async_wait<STAGES - 2>();
    __syncwarp();
    if (item + STAGES - 1 < count) issue(item + STAGES - 1);
    tc::cp_async_commit();
    const uint4* st = mine + (item % STAGES) * STAGE;
#pragma unroll
    for (int i = 0; i < SLOTS; ++i) {
      if (lane + 32 * i < STAGE) {
        const uint4 v = st[lane + 32 * i];
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
      }
    }
  }
  if (acc == 0x9E3779B9u) sink[0] = acc;
}
"""
# The 8B's down projections (4096 x 14336) as matvec_mma_norm plans them: (label, ggml block bytes, pieces a row of a
# stage, pair stride in a row, warps a tile, ring stages).
DOWNS = [("Q4_K down", 144, 18, 288, 8, 2), ("Q6_K down", 210, 27, 420, 4, 2)]
DOWN_ROWS, DOWN_COLS = 4096, 14336


def main() -> None:
    stream = runtime.stream()
    names = [f"glu_copies<{s}, {'true' if t else 'false'}>" for s in STAGES for t in (False, True)]
    compiled = compiler.compile_source(SOURCE, "bench_copy_pattern.cu", runtime.context().info.arch, names=names)
    module = driver.Module(compiled.cubin)
    nbytes = ROWS * ROW_BYTES
    buffers = [empty((2 * nbytes,), np.uint8) for _ in range(COPIES)]  # gate, then up (tiled: both, one piece)
    sink = empty((1,), np.uint32)
    pairs = COLS // 512
    print(f"{'stages':>6} {'layout':<6} {'us':>8} {'TB/s':>6}")
    for name in names:
        fn = module.function(compiled.lowered[name])
        stages = int(name.split("<")[1].split(",")[0])
        shared = 4 * stages * STAGE
        driver.set_max_dynamic_shared(fn, shared)
        tiled = "true" in name

        def launch_all(fn=fn, shared=shared):
            for weights in buffers:
                args = (weights.ptr, weights.ptr + nbytes, ROW_BYTES, pairs, sink.ptr)
                driver.launch(fn, (ROWS // 32,), (128,), args, (_P, _P, _L, _I, _P), stream, shared, pdl=True)

        launch_all()
        us = time_in_graph(stream, launch_all, COPIES)
        print(f"{stages:>6} {'tiled' if tiled else 'rows':<6} {us:>8.2f} {2 * nbytes / us / 1e6:>6.2f}")
    downs(stream)


def downs(stream) -> None:
    """The down projection's copies (matvec_mma_norm's blocks and warps), each format from rows and tiled."""
    names = {(label, tiled): f"norm_copies<{stages}, {str(tiled).lower()}, {pieces}, {pair}, {warps}>"
             for label, _, pieces, pair, warps, stages in DOWNS for tiled in (False, True)}  # fmt: skip
    compiled = compiler.compile_source(SOURCE, "bench_copy_pattern.cu", runtime.context().info.arch,
                                       names=list(names.values()))  # fmt: skip
    module = driver.Module(compiled.cubin)
    sink = empty((1,), np.uint32)
    print(f"{'down':<10} {'layout':<6} {'us':>8} {'TB/s':>6}")
    for label, block, pieces, _, warps, stages in DOWNS:
        row_bytes = DOWN_COLS // 256 * block
        pairs = DOWN_COLS // 512
        nbytes = DOWN_ROWS * row_bytes  # GGUF rows; tiled: pairs of 16 pieces x rows, slightly more (Q6_K's padding)
        buffers = [empty((DOWN_ROWS * pairs * pieces * 16 + 64,), np.uint8) for _ in range(2 * COPIES)]
        shared = 2 * warps * stages * 16 * pieces * 16
        for tiled in (False, True):
            fn = module.function(compiled.lowered[names[(label, tiled)]])
            driver.set_max_dynamic_shared(fn, shared)

            def launch_all(fn=fn, shared=shared, row_bytes=row_bytes, pairs=pairs, buffers=buffers, warps=warps):
                for w in buffers:
                    driver.launch(fn, (DOWN_ROWS // 32,), (64 * warps,), (w.ptr, row_bytes, pairs, sink.ptr),
                                  (_P, _L, _I, _P), stream, shared, pdl=True)  # fmt: skip

            launch_all()
            us = time_in_graph(stream, launch_all, len(buffers))
            print(f"{label:<10} {'tiled' if tiled else 'rows':<6} {us:>8.2f} {nbytes / us / 1e6:>6.2f}")


if __name__ == "__main__":
    main()
