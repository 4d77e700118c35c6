"""What a linear-layer definition on the fp16 tensor cores could rely on (GPU).

    python scripts/probe_fp16_definition.py [--cases 4096]

Batch invariance by default (issue 29) needs one numeric definition that the batch-1 mat-vec, the skinny GEMM and the
GEMM all compute. The default mode's batched paths run `mma.sync.m16n8k16` on fp16 operands with fp32 sums; a
definition built on that instruction would cost them nothing if its bits did not depend on where an operand sits in
the instruction. This probe asks the GPU:

1. Is a D element a function of its own A row, B column and C value only (other rows and columns random, its column
   moved to another place)?
2. Does permuting the 16 k positions (the same permutation of A's columns and B's rows) change D's bits, i.e. may
   kernels feed a k-chunk's elements in different lane orders?
3. How does D compare with C + the exact sum of the 16 products, rounded once to fp32 (the product terms span many
   exponents, with cancellation)?
4. Today's kernels: the skinny GEMM's rows at 3 / 17 / 64 tokens and the fp16 GEMM's at 65 / 128 / 512 tokens (every
   tile), for the same input rows: bitwise equal within each kernel and across the two?

5. Is D the same with the operands' roles swapped (weights as B's columns and tokens as A's rows, D transposed), so
   that a kernel may put eight weight rows in an instruction instead of sixteen?
6. How many cycles does one mma.m16n8k16 take in a chain of dependent ones (each on the last one's D), and with 2, 4
   and 8 chains interleaved in one warp: what a split's chain of 16 instructions a superblock costs in latency, and so
   how wide a split may be before its chain, not the bytes, bounds a mat-vec.

It prints one line per question with the count of differing elements (the cycles for 6).
"""

from __future__ import annotations

import argparse
import ctypes

import numpy as np

SOURCE = r"""
#include <cuda_fp16.h>
// One m16n8k16 per warp: A [16][16] row-major, B [16 k][8 n], C and D [16][8] float, case w at offset w of each.
extern "C" __global__ void mma_case(const __half* __restrict__ a, const __half* __restrict__ b,
                                    const float* __restrict__ c, float* __restrict__ d, int cases) {
  const int w = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31, g = lane >> 2, j = lane & 3;
  if (w >= cases) return;
  const __half* A = a + 256 * w;
  const __half* B = b + 128 * w;
  const float* C = c + 128 * w;
  auto pair = [](__half lo, __half hi) {
    return (unsigned)__half_as_ushort(lo) | ((unsigned)__half_as_ushort(hi) << 16);
  };
  const unsigned a0 = pair(A[16 * g + 2 * j], A[16 * g + 2 * j + 1]);
  const unsigned a1 = pair(A[16 * (g + 8) + 2 * j], A[16 * (g + 8) + 2 * j + 1]);
  const unsigned a2 = pair(A[16 * g + 2 * j + 8], A[16 * g + 2 * j + 9]);
  const unsigned a3 = pair(A[16 * (g + 8) + 2 * j + 8], A[16 * (g + 8) + 2 * j + 9]);
  const unsigned b0 = pair(B[8 * (2 * j) + g], B[8 * (2 * j + 1) + g]);
  const unsigned b1 = pair(B[8 * (2 * j + 8) + g], B[8 * (2 * j + 9) + g]);
  float acc[4] = {C[8 * g + 2 * j], C[8 * g + 2 * j + 1], C[8 * (g + 8) + 2 * j], C[8 * (g + 8) + 2 * j + 1]};
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};"
               : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  float* D = d + 128 * w;
  D[8 * g + 2 * j] = acc[0];
  D[8 * g + 2 * j + 1] = acc[1];
  D[8 * (g + 8) + 2 * j] = acc[2];
  D[8 * (g + 8) + 2 * j + 1] = acc[3];
}

// One warp: CHAINS accumulators, each advanced n times by a dependent mma; the cycles the loop took.
template <int CHAINS>
__device__ void chain(float* out, long long* cycles, int n) {
  const unsigned a[4] = {0x3C003C00u, 0x3C003C00u, 0x3C003C00u, 0x3C003C00u};  // 1.0
  const unsigned b0 = 0x14001400u, b1 = 0x14001400u;                           // 2^-10
  float acc[CHAINS][4] = {};
  __syncwarp();
  const long long t0 = clock64();
#pragma unroll 1
  for (int i = 0; i < n; ++i) {
#pragma unroll
    for (int c = 0; c < CHAINS; ++c)
      asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                   "{%0,%1,%2,%3};"
                   : "+f"(acc[c][0]), "+f"(acc[c][1]), "+f"(acc[c][2]), "+f"(acc[c][3])
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  const long long t1 = clock64();
  float sum = 0.f;
#pragma unroll
  for (int c = 0; c < CHAINS; ++c) sum += acc[c][0] + acc[c][1] + acc[c][2] + acc[c][3];
  out[threadIdx.x] = sum;
  if (threadIdx.x == 0) *cycles = t1 - t0;
}
extern "C" __global__ void mma_chain1(float* out, long long* cycles, int n) { chain<1>(out, cycles, n); }
extern "C" __global__ void mma_chain2(float* out, long long* cycles, int n) { chain<2>(out, cycles, n); }
extern "C" __global__ void mma_chain4(float* out, long long* cycles, int n) { chain<4>(out, cycles, n); }
extern "C" __global__ void mma_chain8(float* out, long long* cycles, int n) { chain<8>(out, cycles, n); }
"""


def operands(rng: np.random.Generator, cases: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """fp16 A [cases, 16, 16], B [cases, 16, 8] and fp32 C [cases, 16, 8] whose products span ~2^-12 .. 2^12 with
    mixed signs, so that partial sums cancel and the alignment of small terms against large ones shows."""

    def spread(shape):
        return (rng.choice([-1.0, 1.0], size=shape) * 2.0 ** rng.integers(-6, 7, size=shape)
                * rng.uniform(1, 2, size=shape))  # fmt: skip

    a = spread((cases, 16, 16)).astype(np.float16)
    b = spread((cases, 16, 8)).astype(np.float16)
    c = (spread((cases, 16, 8)) * 4).astype(np.float32)
    return a, b, c


class MmaProbe:
    def __init__(self):
        from infero.backends.cuda import compiler, driver, runtime

        ctx = runtime.context()
        compiled = compiler.compile_source(SOURCE, "probe_mma.cu", ctx.info.arch)
        self.module = driver.Module(compiled.cubin)
        self.fn = self.module.function("mma_case")
        self.stream = runtime.stream()

    def __call__(self, a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
        from infero.backends.cuda import driver
        from infero.backends.cuda.tensor import empty, from_host

        cases = a.shape[0]
        ad, bd, cd = from_host(a), from_host(b), from_host(c)
        d = empty(c.shape, np.float32)
        args = (ad.ptr, bd.ptr, cd.ptr, d.ptr, cases)
        types = (ctypes.c_void_p,) * 4 + (ctypes.c_int,)
        driver.launch(self.fn, (-(-cases // 4),), (128,), args, types, self.stream)
        self.stream.synchronize()
        return d.to_host()


def differing(x: np.ndarray, y: np.ndarray) -> int:
    return int(np.count_nonzero(x.view(np.uint32) != y.view(np.uint32)))


def probe_mma(cases: int) -> None:
    rng = np.random.default_rng(0)
    mma = MmaProbe()
    a, b, c = operands(rng, cases)
    d = mma(a, b, c)
    total = d.size

    # 1. Other rows and columns replaced, each case's column 0 moved to column 5 and row 0 to row 11.
    a2, b2, c2 = operands(np.random.default_rng(1), cases)
    a2[:, 11], b2[:, :, 5], c2[:, 11, 5] = a[:, 0], b[:, :, 0], c[:, 0, 0]
    moved = mma(a2, b2, c2)
    print(f"1. element moved to another row and column, the others random: "
          f"{differing(moved[:, 11, 5].copy(), d[:, 0, 0].copy())} of {cases} differ")  # fmt: skip

    # 2. The same k permutation of A's columns and B's rows, one per case.
    perm = np.argsort(rng.random((cases, 16)), axis=1)
    ap = np.take_along_axis(a, perm[:, None, :], axis=2)
    bp = np.take_along_axis(b, perm[:, :, None], axis=1)
    permuted = mma(ap, bp, c)
    swapped = np.concatenate([np.arange(8, 16), np.arange(8)])  # the two 8-element halves swapped
    halves = mma(a[:, :, swapped], b[:, swapped, :], c)
    print(f"2. k permuted at random: {differing(permuted, d)} of {total} elements differ; "
          f"k halves swapped: {differing(halves, d)}")  # fmt: skip

    # 3. Against C + the exact sum of the products, rounded once (float64 holds it: the products have 22 significant
    # bits and lie in 2^-12 .. 2^17, C below 2^11, so the exact sum needs at most ~51 bits).
    exact = c.astype(np.float64) + np.einsum("wik,wkn->win", a.astype(np.float64), b.astype(np.float64))
    once = exact.astype(np.float32)
    seq = c.copy()
    for k in range(16):
        seq = (seq + (a[:, :, k, None].astype(np.float32) * b[:, None, k, :].astype(np.float32))).astype(np.float32)
    print(f"3. D against the exact sum rounded once: {differing(d, once)} of {total} differ "
          f"(max |diff| / |exact| {float(np.max(np.abs(d - exact) / np.maximum(np.abs(exact), 1e-30))):.2e}); "
          f"against fp32 adds in k order: {differing(d, seq)}")  # fmt: skip

    # 5. Roles swapped: A's first 8 rows as B's columns, B's 8 columns as A's first 8 rows (the rest random), C
    # transposed: D[r, t] against the swapped call's D[t, r].
    a3, b3, c3 = operands(np.random.default_rng(3), cases)
    a3[:, :8, :] = np.transpose(b, (0, 2, 1))
    b3[:, :, :] = np.transpose(a[:, :8, :], (0, 2, 1))
    c3[:, :8, :] = np.transpose(c[:, :8, :], (0, 2, 1))
    back = np.transpose(mma(a3, b3, c3)[:, :8, :], (0, 2, 1)).copy()
    print(f"5. operands' roles swapped: {differing(back, d[:, :8, :].copy())} of {cases * 64} elements differ")


def probe_chain() -> None:
    from infero.backends.cuda import driver
    from infero.backends.cuda.tensor import empty

    mma = MmaProbe()
    out, cycles, n = empty((32,), np.float32), empty((1,), np.int64), 4096
    line = []
    for chains in (1, 2, 4, 8):
        fn = mma.module.function(f"mma_chain{chains}")
        for _ in range(2):  # the first launch warms the instruction cache
            driver.launch(fn, (1,), (32,), (out.ptr, cycles.ptr, n), (ctypes.c_void_p,) * 2 + (ctypes.c_int,),
                          mma.stream)  # fmt: skip
        mma.stream.synchronize()
        line.append(f"{chains} chain{'s' if chains > 1 else ''} {int(cycles.to_host()[0]) / (n * chains):.1f}")
    print("6. cycles a dependent mma.m16n8k16 (one warp): " + ", ".join(line) + " a mma")


def probe_kernels() -> None:
    from infero.backends.cuda import gemm, runtime, skinny_gemm
    from infero.backends.cuda.tensor import QuantWeight, Workspace, empty, from_host
    from infero.checkpoint.synthetic import encode_weight

    stream = runtime.stream()
    rows, cols, qtype = 4096, 4096, 12  # Q4_K
    rng = np.random.default_rng(2)
    data = encode_weight(rng.normal(0, 0.05, size=(rows, cols)).astype(np.float32), qtype, rng)
    weight = QuantWeight(from_host(np.ascontiguousarray(data).view(np.uint8).reshape(rows, -1)), qtype, rows, cols)
    x = rng.normal(0, 1, size=(512, cols)).astype(np.float32)

    def skinny(n):
        out = empty((n, rows), np.float32)
        xa = empty(skinny_gemm.activation_shape(n, cols), np.uint32)
        ws = Workspace(skinny_gemm.MAX_SPLITS * n * rows * 4 + (1 << 20))
        skinny_gemm.convert(xa, from_host(x[:n]), qtype, stream)
        skinny_gemm.skinny_gemm(out, weight, xa, None, stream, ws)
        stream.synchronize()
        return out.to_host()[:3]

    def fp16_gemm(n, tile):
        out = empty((n, rows), np.float32)
        ws = Workspace(n * (cols + 64) * 2 + (1 << 20))
        gemm.gemm(out, weight, from_host(x[:n]), None, stream, ws, tile=tile)
        stream.synchronize()
        return out.to_host()[:3]

    limit = runtime.context().info.max_shared_per_block_optin
    tiles = [t for t in gemm.TILES if gemm.shared_bytes(qtype, t) <= limit]
    s = {n: skinny(n) for n in (3, 17, 64)}
    g = {(n, t): fp16_gemm(n, t) for n in (65, 128, 512) for t in tiles}
    ref_s, ref_g = s[3], next(iter(g.values()))
    print(f"4. Q4_K {rows}x{cols}, the first 3 rows: skinny at 17 / 64 tokens against 3: "
          f"{differing(s[17], ref_s)} / {differing(s[64], ref_s)} of {ref_s.size} differ; "
          f"the GEMM's {len(g)} (tokens, tile) cases against its first: "
          f"{sum(differing(v, ref_g) for v in g.values())} in all; skinny against the GEMM: "
          f"{differing(ref_s, ref_g)} (max |diff| {float(np.max(np.abs(ref_s - ref_g))):.2e})")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=4096)
    args = parser.parse_args()
    probe_mma(args.cases)
    probe_kernels()
    probe_chain()


if __name__ == "__main__":
    main()
