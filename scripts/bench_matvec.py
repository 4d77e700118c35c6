"""Mat-vec kernel sweep (GPU machine): for each weight type and shape, every (rows per warp, warps per block,
prefetch depth) variant of matvec_q timed inside a CUDA graph, with the weight bytes per second it reached.

    python scripts/bench_matvec.py [--shapes 8b,0.5b] [--n 1]      the sweep, one table per shape
    python scripts/bench_matvec.py --shapes steady                  each format's rate with no launch gaps
    python scripts/bench_matvec.py --once                           each shape's default variant once (for ncu)
    python scripts/bench_matvec.py --shapes steady,8b --types Q6_K  only some weight types
    python scripts/bench_matvec.py --plan                           only the variant matvec.plan picks
    python scripts/bench_matvec.py --plan --hot                     ... on one copy: L2-resident where it fits

Each graph launches the kernel on REPS different copies of the weight (more bytes than the L2 holds), back to back
with programmatic dependent launch as in a forward pass, so a launch's time includes its share of the gaps.
"""

from __future__ import annotations

import argparse

import numpy as np

from infero.backends.cuda import driver, matvec, runtime
from infero.backends.cuda.tensor import QuantWeight, empty, from_host
from infero.checkpoint.synthetic import random_blocks
from infero.checkpoint.tensor_types import GGMLType

SHAPES = {
    "8b": [("Q4_K", 14336, 4096), ("Q4_K", 4096, 4096), ("Q4_K", 1024, 4096), ("Q6_K", 4096, 14336),
           ("Q4_K", 4096, 14336), ("Q6_K", 1024, 4096), ("Q6_K", 128256, 4096)],
    "30b-a3b": [("Q4_K", 4096, 2048), ("Q4_K", 512, 2048), ("Q6_K", 512, 2048), ("Q4_K", 2048, 4096)],
    "0.5b": [("Q8_0", 4864, 896), ("Q8_0", 896, 896), ("Q8_0", 128, 896), ("Q8_0", 896, 4864),
             ("Q8_0", 151936, 896)],
    # The block formats whose blocks are only 2- or 4-byte aligned (their windows are shifted into place).
    "formats": [(t, rows, 4096) for t in ("Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q2_K", "Q3_K", "IQ4_NL")
                for rows in (4096, 14336)],
    # ~0.4-0.5 GB each, the widths of the decode matrices: a launch's ramp and tail are ~2% of its time, so these
    # give the rate each format's loop streams at once it is running: what a persistent decode kernel, which has
    # no launches between matrices, could reach at most (docs/performance.md).
    "steady": [("Q4_K", 229376, 4096), ("Q4_K", 65536, 14336), ("Q6_K", 131072, 4096), ("Q6_K", 32768, 14336),
               ("Q8_0", 524288, 896)],
}  # fmt: skip
L2_BYTES = 50 << 20
ARGS = matvec._Q_ARGS


def weights(qtype: int, rows: int, cols: int, copies: int, rng) -> list[QuantWeight]:
    blocks = random_blocks(qtype, rows, cols, rng, 0.02)
    return [QuantWeight(from_host(blocks), qtype, rows, cols) for _ in range(copies)]


def weights_past_l2(qtype: int, rows: int, cols: int, rng) -> list[QuantWeight]:
    """Copies of one random weight holding about twice the L2 (at least two): timed back to back, none is cached."""
    probe = weights(qtype, rows, cols, 1, rng)
    return probe + weights(qtype, rows, cols, max(1, -(-2 * L2_BYTES // probe[0].data.nbytes) - 1), rng)


def launch_args(out, w, xq, xs, n) -> tuple:
    """matvec_q's arguments for one matrix (a single segment)."""
    return (matvec.segments([out], [w], [None]), xq.ptr, xs.ptr, n, w.cols, w.data.shape[1], matvec.Rope())


def time_in_graph(stream, launch_all, launches: int, replays: int = 7) -> float:
    """Median microseconds per launch of launch_all() (which makes `launches` launches), captured as one graph."""
    graph = driver.Graph(stream, launch_all)
    graph.replay(stream)
    stream.synchronize()
    start, end, times = driver.Event(), driver.Event(), []
    for _ in range(replays):
        start.record(stream)
        graph.replay(stream)
        end.record(stream)
        end.synchronize()
        times.append(end.elapsed_ms(start) * 1e3 / launches)
    return float(np.median(times))


def time_variant(stream, fn, grid, block, ws, xq, xs, out, n) -> float:
    def launch_all():
        for w in ws:
            driver.launch(fn, grid, block, launch_args(out, w, xq, xs, n), ARGS, stream, pdl=True)

    return time_in_graph(stream, launch_all, len(ws))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="8b,0.5b")
    parser.add_argument("--n", type=int, default=1)
    parser.add_argument("--types", help="only these weight types (comma-separated, e.g. Q6_K)")
    parser.add_argument("--once", action="store_true")
    parser.add_argument("--plan", action="store_true", help="time only the planned variant (nothing to compile)")
    parser.add_argument("--hot", action="store_true", help="every launch reads one copy: from the L2 where it fits")
    args = parser.parse_args()
    stream, sms, rng, n = runtime.stream(), runtime.context().info.num_sms, np.random.default_rng(0), args.n
    shapes = [s for key in args.shapes.split(",") for s in SHAPES[key]]
    if args.types:
        shapes = [s for s in shapes if s[0] in args.types.split(",")]
    big_n = next(b for b in matvec.TOKEN_BUCKETS if b >= n)
    types = sorted({int(GGMLType[name]) for name, _, _ in shapes})
    # n = 1: rows per warp and prefetch depth; batches (no prefetch ring): two or four rows per warp.
    variants = [(rpw, a) for rpw in (1, 2) for a in (-1, 1, 2, 3, 4)] if big_n == 1 else [(2, -1), (4, -1)]
    if not args.plan:
        runtime.declare(
            "matvec.cu", [f"matvec_q<{t}, {big_n}, {rpw}, {a}>" for t in types for rpw, a in variants]
        )  # fmt: skip  (one compile for the whole sweep)
    for name, rows, cols in shapes:
        qtype = int(GGMLType[name])
        nbytes = rows * len(random_blocks(qtype, 1, cols, rng, 0.02)[0])
        launches = 1 if args.once else max(2, -(-3 * L2_BYTES // nbytes))
        ws = weights(qtype, rows, cols, 1, rng) * launches if args.hot else weights(qtype, rows, cols, launches, rng)
        x = from_host(rng.normal(0, 1, size=(n, cols)).astype(np.float32))
        q_shape, s_shape = matvec.activation_shapes(n, cols)
        xq, xs = empty(q_shape, np.int8), empty(s_shape, np.int32)
        matvec.quantize(xq, xs, x, stream)
        out = empty((n, rows), np.float32)
        big_n, rpw0, wpb0, ahead0 = matvec.plan(rows, n, sms, qtype, cols // matvec.UNIT_ELEMS.get(qtype, 32))
        if args.once:
            fn = runtime.kernel("matvec.cu", f"matvec_q<{qtype}, {big_n}, {rpw0}, {ahead0}>")
            args_ = launch_args(out, ws[0], xq, xs, n)
            driver.launch(fn, (-(-rows // (rpw0 * wpb0)),), (32 * wpb0,), args_, ARGS, stream)
            stream.synchronize()
            continue
        results = []
        for rpw, ahead in [(rpw0, ahead0)] if args.plan else variants:
            fn = runtime.kernel("matvec.cu", f"matvec_q<{qtype}, {big_n}, {rpw}, {ahead}>")
            for wpb in (wpb0,) if args.plan else (1, 2, 4):
                us = time_variant(stream, fn, (-(-rows // (rpw * wpb)),), (32 * wpb,), ws, xq, xs, out, n)
                default = (rpw, wpb, ahead) == (rpw0, wpb0, ahead0)
                results.append((us, rpw, wpb, ahead, default))
        results.sort()
        copies = f"one copy, {len(ws)} launches" if args.hot else f"{len(ws)} copies"
        print(f"\n{name} {rows}x{cols} n={n}: {nbytes / 2**20:.1f} MiB, {copies}; fastest first")
        print(f"{'us':>8} {'GB/s':>7}  rpw wpb ahead")
        for us, rpw, wpb, ahead, default in results[:6] + [r for r in results[6:] if r[4]]:
            mark = "  <- default" if default else ""
            print(f"{us:8.2f} {nbytes / us / 1e3:7.0f}  {rpw:>3} {wpb:>3} {ahead:>5}{mark}")


if __name__ == "__main__":
    main()
