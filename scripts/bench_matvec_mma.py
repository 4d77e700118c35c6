"""The mat-vec on the tensor cores (matvec_mma) against the __dp4a kernel (matvec_q) on the same weights (GPU).

    python scripts/bench_matvec_mma.py [--n 1] [--hot] [--types Q4_K,Q6_K]

For each shape (the 8B's decode matrices and a ~0.5 GB one, whose launch ramp and tail are ~2% of its time):
matvec_q as matvec.plan would run it and matvec_mma at every (warps, stages) of matvec.MMA_SHAPES, each
timed in a graph over weight copies past the L2 (one copy with --hot), the kernels alternating, median of 3; and
how many outputs of the matvec_mma shapes differ in any bit from matvec_q's (0: both compute unit_value.cuh's
definition).
"""

from __future__ import annotations

import argparse

import numpy as np
from bench_matvec import ARGS, L2_BYTES, launch_args, time_in_graph, weights

from infero.backends.cuda import driver, matvec, runtime
from infero.backends.cuda.tensor import empty, from_host
from infero.checkpoint.synthetic import random_blocks
from infero.checkpoint.tensor_types import GGMLType

SHAPES = {
    "Q4_K": [(14336, 4096), (28672, 4096), (4096, 4096), (6144, 4096), (1024, 4096), (4096, 14336), (229376, 4096)],
    # the 8B's Q6_K matrices (down of half the layers, v of half, the output head) and a one-wave square
    "Q6_K": [(4096, 14336), (1024, 4096), (4096, 4096), (14336, 4096), (128256, 4096)],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1, help="tokens")
    parser.add_argument("--hot", action="store_true", help="every launch reads one copy: from the L2 where it fits")
    parser.add_argument("--types", default="Q4_K", help="the types matvec_mma runs (matvec.MMA_ROW)")
    args = parser.parse_args()
    for name in args.types.split(","):
        run(int(GGMLType[name]), SHAPES[name], args.n, args.hot)


def run(t: int, shapes: list[tuple[int, int]], n: int, hot: bool) -> None:
    ctx, stream, rng = runtime.context(), runtime.stream(), np.random.default_rng(0)
    big_n = next(b for b in matvec.TOKEN_BUCKETS if b >= n)
    print(f"\n{GGMLType(t).name}, n={n}, {'one copy (L2 where it fits)' if hot else 'copies past the L2'}; us (GB/s)")
    mma_names = [f"mma {w}x{s}" for w, s in matvec.MMA_SHAPES]
    print(f"{'shape':<14} {'matvec_q':>14} " + " ".join(f"{m:>14}" for m in mma_names) + "  planned  differing")
    for rows, cols in shapes:
        nbytes = rows * len(random_blocks(t, 1, cols, rng, 0.02)[0])
        launches = max(2, -(-3 * L2_BYTES // nbytes))
        ws = weights(t, rows, cols, 1, rng) * launches if hot else weights(t, rows, cols, launches, rng)
        x = from_host(rng.normal(0, 1, size=(n, cols)).astype(np.float32))
        q_shape, s_shape = matvec.activation_shapes(n, cols)
        xq, xs = empty(q_shape, np.int8), empty(s_shape, np.int32)
        matvec.quantize(xq, xs, x, stream)
        _, rpw, wpb, ahead = matvec.plan(rows, n, ctx.info.num_sms, t, cols // 32)
        warps = -(-rows // rpw)
        kernels = {"matvec_q": (matvec._kernel(f"matvec_q<{t}, {big_n}, {rpw}, {ahead}>"), (-(-warps // wpb),),
                                (32 * wpb,), 0, (), ARGS)}  # fmt: skip
        for name, (w, s) in zip(mma_names, matvec.MMA_SHAPES, strict=True):
            fn = matvec._kernel(f"matvec_mma<{t}, {big_n}, {w}, {s}, false>")
            shared = matvec.mma_shared(t, w, s, n, cols)
            driver.set_max_dynamic_shared(fn, shared)
            kernels[name] = (fn, (-(-rows // 16),), (32 * w,), shared, (0, 0.0), matvec._MMA_ARGS)  # no deferred norm
        outs = {}
        for name, (fn, grid, block, shared, extra, types) in kernels.items():
            out = empty((n, rows), np.float32)
            driver.launch(fn, grid, block, launch_args(out, ws[0], xq, xs, n) + extra, types, stream, shared)
            stream.synchronize()
            outs[name] = out.to_host()
        ref = outs["matvec_q"].view(np.uint32)
        differing = sum(int((o.view(np.uint32) != ref).sum()) for o in outs.values())
        out = empty((n, rows), np.float32)
        every = [launch_args(out, w, xq, xs, n) for w in ws]
        times: dict[str, list[float]] = {name: [] for name in kernels}
        for _ in range(3):
            for name, (fn, grid, block, shared, extra, types) in kernels.items():

                def launch_all(fn=fn, grid=grid, block=block, shared=shared, every=every, extra=extra, types=types):
                    for a in every:
                        driver.launch(fn, grid, block, a + extra, types, stream, shared, pdl=True)

                times[name].append(time_in_graph(stream, launch_all, len(ws)))
        cells = [f"{us:6.2f} ({nbytes / us / 1e3:5.0f})" for us in (float(np.median(times[k])) for k in kernels)]
        planned = "mma {}x{}".format(*matvec.mma_plan(t, -(-rows // 16), cols, ctx.info.num_sms))
        print(f"{rows}x{cols:<8} " + " ".join(f"{c:>14}" for c in cells) + f"  {planned}  {differing}")


if __name__ == "__main__":
    main()
