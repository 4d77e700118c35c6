"""The decode mat-vecs over Q4_K and Q6_K weights in the tiled layout against the GGUF rows (GPU machine), one token:

    python scripts/bench_tiled.py

Tiled (weight_layout.py): each group of 8 rows stored superblock pair after pair ([rows / 8][pairs][8][2 slots], a
slot a superblock: Q4_K's 144 bytes, Q6_K's 210 and 6 zero bytes), so that each half of a ring stage (8 rows of one
pair) is one contiguous copy where the GGUF layout has 8 pieces a row apart (matvec.cu's MmaCopy; the same kernels
read both layouts: Segments::tiled). llama-3.1-8b's gate + up (`matvec_mma_glu`), down and o projections
(`matvec_mma_norm`, the plan's warps and stages; its downs in Q4_K and Q6_K), and q/k/v with rotary and the K/V write
(`matvec_mma`, Q4_K q and k with Q6_K v: a Q6_K layer's); each checked bitwise against the GGUF layout's launch,
then both timed as `bench_norm_fold.py` times (a graph with PDL over copies past the L2, median of 7), twice in turn;
microseconds a launch.
"""

from __future__ import annotations

import numpy as np
from bench_matvec import time_in_graph
from bench_norm_fold import activation

from infero.backends.cuda import driver, matvec, runtime, weight_layout
from infero.backends.cuda.tensor import QuantWeight, from_host
from infero.checkpoint.synthetic import random_blocks
from infero.checkpoint.tensor_types import GGMLType

Q4_K, Q6_K = int(GGMLType.Q4_K), int(GGMLType.Q6_K)
COPIES = 3  # of each matrix, launched in turn: past the L2
GLU = f"matvec_mma_glu<{Q4_K}, 1, {matvec.GLU_STAGES}>"
HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
QKV_WARPS, QKV_STAGES = 4, 2  # mma_plan's for the 8B's 384 q/k/v tiles
QKV = f"matvec_mma<{Q4_K}, 1, {QKV_WARPS}, {QKV_STAGES}, true, {Q6_K}>"
NORMS = [(Q4_K, 4096, 14336), (Q6_K, 4096, 14336), (Q4_K, 4096, 4096)]  # the 8B's downs and o (type, rows, cols)


def norm_shape(t: int, rows: int, cols: int) -> tuple[int, int, int]:
    return matvec._norm_launch(t, rows, cols, 1)  # warps a tile, stages, dynamic shared memory


def norm_name(t: int, rows: int, cols: int) -> str:
    warps, stages, _ = norm_shape(t, rows, cols)
    return f"matvec_mma_norm<{t}, 1, {warps}, {stages}>"


def both_layouts(t: int, rows: int, cols: int, rng) -> dict[bool, QuantWeight]:
    raw = random_blocks(t, rows, cols, rng, 0.02)
    return {False: QuantWeight(from_host(raw), t, rows, cols),
            True: QuantWeight(from_host(weight_layout.tiled(raw, t)), t, rows, cols, tiled=True)}  # fmt: skip


def compare(label: str, launch, outputs, reset, launches: int) -> None:
    """Bitwise check of one launch in each layout, then the times, twice in turn."""
    results = []
    for tiled in (False, True):
        reset()
        launch(tiled, 1)
        runtime.stream().synchronize()
        results.append([out.to_host() for out in outputs])
    for a, b in zip(*results, strict=True):
        if not np.array_equal(a.view(np.uint8), b.view(np.uint8)):
            raise SystemExit(f"{label}: the tiled layout's output differs")
    times = [time_in_graph(runtime.stream(), lambda t=tiled: launch(t, launches), launches)
             for _ in range(2) for tiled in (False, True)]  # fmt: skip
    rows, tiled = (times[0] + times[2]) / 2, (times[1] + times[3]) / 2
    runs = " / ".join(f"{t:.2f}" for t in times)
    print(f"{label:<34} {rows:>8.2f} {tiled:>9.2f} {tiled - rows:>+7.2f}   ({runs})")


def main() -> None:
    runtime.declare(matvec.SOURCE, [GLU, QKV] + [norm_name(*shape) for shape in NORMS])
    stream, rng = runtime.stream(), np.random.default_rng(0)
    print(f"{'kernel':<34} {'rows us':>8} {'tiled us':>9} {'diff':>7}   (rows / tiled / rows / tiled)")

    rows, cols = 14336, 4096
    gates = [both_layouts(Q4_K, rows, cols, rng) for _ in range(COPIES)]
    ups = [both_layouts(Q4_K, rows, cols, rng) for _ in range(COPIES)]
    x = activation(1, cols, True)
    matvec.quantize(x.q, x.s, from_host(rng.normal(0, 1, size=(1, cols)).astype(np.float32)), stream)
    driver.copy_host_to_device(x.norm_ss.ptr, np.full((1, cols // 32), 32.0, np.float32))
    out, y = from_host(np.zeros((1, rows), np.float32)), activation(1, rows, False)
    shared = matvec._glu_shared(Q4_K, 1, cols, True)

    def glu(tiled: bool, copies: int) -> None:
        fn = matvec._kernel(GLU)
        matvec._allow_shared(fn, shared)
        for gate, up in zip(gates[:copies], ups[:copies], strict=True):
            args = (matvec.segments([out, out], [gate[tiled], up[tiled]], [None, None]), x.q.ptr, x.s.ptr, 1, cols,
                    gate[False].data.shape[1], y.q.ptr, y.s.ptr, 1, x.eps)  # fmt: skip
            driver.launch(fn, (rows // 32,), (128,), args, matvec._GLU_ARGS, stream, shared, pdl=True)

    compare(f"gate + up {rows}+{rows} x {cols}", glu, [out, y.q, y.s], stream.synchronize, COPIES)

    for t, rows, cols in NORMS:
        weights = [both_layouts(t, rows, cols, rng) for _ in range(2 * COPIES)]
        x = activation(1, cols, False)
        matvec.quantize(x.q, x.s, from_host(rng.normal(0, 1, size=(1, cols)).astype(np.float32)), stream)
        residual0 = rng.normal(0, 3, size=(1, rows)).astype(np.float32)
        residual, norm = from_host(residual0), from_host(rng.uniform(0.5, 2, size=rows).astype(np.float32))
        y = activation(1, rows, True)
        warps, _, shared = norm_shape(t, rows, cols)

        def norm_launch(layout: bool, copies: int, t=t, rows=rows, cols=cols, weights=weights, x=x, y=y,
                        residual=residual, norm=norm, warps=warps, shared=shared) -> None:  # fmt: skip
            fn = matvec._kernel(norm_name(t, rows, cols))
            matvec._allow_shared(fn, shared)
            for w in weights[:copies]:
                args = (matvec.segments([residual], [w[layout]], [None]), x.q.ptr, x.s.ptr, 1, cols,
                        w[layout].data.shape[1], residual.ptr, norm.ptr, y.q.ptr, y.s.ptr, y.norm_ss.ptr)  # fmt: skip
                driver.launch(fn, (rows // 32,), (64 * warps,), args, matvec._NORM_ARGS, stream, shared, pdl=True)

        def reset(residual=residual, residual0=residual0) -> None:
            stream.synchronize()
            driver.copy_host_to_device(residual.ptr, residual0)

        compare(
            f"norm {GGMLType(t).name} {rows} x {cols}", norm_launch, [residual, y.q, y.s, y.norm_ss], reset, 2 * COPIES
        )

    qkv(stream, rng)


def qkv(stream, rng) -> None:
    """q/k/v with rotary and the K/V write, Q4_K q and k with Q6_K v (a Q6_K layer's), all tiled or none."""
    cols, rows = 4096, (HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM)
    weights = [(both_layouts(Q4_K, rows[0], cols, rng), both_layouts(Q4_K, rows[1], cols, rng),
                both_layouts(Q6_K, rows[2], cols, rng)) for _ in range(2 * COPIES)]  # fmt: skip
    x = activation(1, cols, True)
    matvec.quantize(x.q, x.s, from_host(rng.normal(0, 1, size=(1, cols)).astype(np.float32)), stream)
    driver.copy_host_to_device(x.norm_ss.ptr, np.full((1, cols // 32), 32.0, np.float32))
    outs = [from_host(np.zeros((1, r), np.float32)) for r in rows]
    caches = [from_host(np.zeros((4, 16, KV_HEADS, HEAD_DIM), np.float16)) for _ in range(2)]
    positions, slots = from_host(np.array([700], np.int32)), from_host(np.array([37], np.int64))
    inv_freq = from_host((5e5 ** (-np.arange(0, HEAD_DIM, 2) / HEAD_DIM)).astype(np.float32))
    rope = matvec.Rope(positions.ptr, slots.ptr, inv_freq.ptr, caches[0].ptr, caches[1].ptr)
    rope.role[0], rope.role[1], rope.role[2] = 0, 1, 2
    rope.head_dim, rope.mscale = HEAD_DIM, 1.0
    tiles = sum(rows) // 16
    shared = matvec.mma_shared(Q4_K, QKV_WARPS, QKV_STAGES, 1, cols, Q6_K, deferred=True)

    def launch(layout: bool, copies: int) -> None:
        fn = matvec._kernel(QKV)
        matvec._allow_shared(fn, shared)
        for q, k, v in weights[:copies]:
            args = (matvec.segments(outs, [q[layout], k[layout], v[layout]], [None] * 3), x.q.ptr, x.s.ptr, 1, cols,
                    q[False].data.shape[1], rope, 1, x.eps)  # fmt: skip
            driver.launch(fn, (tiles,), (32 * QKV_WARPS,), args, matvec._MMA_ARGS, stream, shared, pdl=True)

    compare("q/k/v 4096+1024+1024 x 4096 (mixed)", launch, outs + caches, stream.synchronize, 2 * COPIES)


if __name__ == "__main__":
    main()
