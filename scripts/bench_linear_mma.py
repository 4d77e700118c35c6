"""linear_mma (int8 tensor cores, the mat-vec's bits) against the skinny GEMM and the fp16 GEMM (GPU machine): for
each shape and token count, microseconds a launch inside a CUDA graph and weight GB/s.

    python scripts/bench_linear_mma.py [--n 17,32,64,128,512] [--shapes Q4_K:14336x4096,...]

As in bench_skinny.py, each graph launches on copies of the weight holding more bytes than the L2, back to back with
programmatic dependent launch, stored as the engine stores them (Q4_K / Q6_K tiled where weight_layout.tiles says
so). Each kernel's activation is made once outside the graph (linear_mma's by matvec.quantize, the skinny GEMM's by
its convert): a forward pass makes it once per activation, not per matrix. The GEMM's column includes its own
per-call conversion of x to fp16. "-": the kernel does not take the shape or count.
"""

from __future__ import annotations

import argparse

import numpy as np
from bench_matvec import L2_BYTES, time_in_graph

from infero.backends.cuda import gemm, linear_mma, matvec, runtime, skinny_gemm, weight_layout
from infero.backends.cuda.tensor import Workspace, empty, from_host
from infero.checkpoint.synthetic import random_blocks
from infero.checkpoint.tensor_types import GGMLType

SHAPES = ("Q4_K:14336x4096,Q4_K:4096x14336,Q4_K:4096x4096,Q4_K:1024x4096,Q6_K:4096x14336,Q6_K:128256x4096,"
          "Q8_0:4096x4096")  # fmt: skip


def weights_as_stored(qtype: int, rows: int, cols: int, rng) -> list:
    """Copies of one random weight holding about twice the L2 (at least two), in the engine's layout."""
    raw = random_blocks(qtype, rows, cols, rng, 0.02).reshape(rows, -1)
    copies = max(2, -(-2 * L2_BYTES // raw.nbytes))
    return [weight_layout.upload(raw, qtype, rows, cols) for _ in range(copies)]


def cell(us: float | None, nbytes: int) -> str:
    return f"{'-':>7} {'':>6}" if us is None else f"{us:7.1f} {nbytes / us / 1e3:6.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", default="17,32,64,128,512")
    parser.add_argument("--shapes", default=SHAPES)
    args = parser.parse_args()
    stream, rng, sms = runtime.stream(), np.random.default_rng(0), runtime.context().info.num_sms
    counts = [int(v) for v in args.n.split(",")]
    print(f"{'weight':<24} {'n':>4} {'splits':>6}  {'linear_mma us GB/s':>18}  {'skinny us GB/s':>16}  "
          f"{'gemm us GB/s':>16}  gemm tile  linear/gemm")  # fmt: skip
    for spec in args.shapes.split(","):
        name, shape = spec.split(":")
        rows, cols = (int(v) for v in shape.split("x"))
        qtype = int(GGMLType[name])
        ws = weights_as_stored(qtype, rows, cols, rng)
        nbytes = ws[0].data.nbytes
        layout = "tiled" if ws[0].tiled else "rows"
        for n in counts:
            x = from_host(rng.normal(0, 1, size=(n, cols)).astype(np.float32))
            out = empty((n, rows), np.float32)
            workspace = Workspace(linear_mma.MAX_SPLITS * n * rows * 12 + n * cols * 4 + (1 << 20))

            mine = None
            if linear_mma.supports(ws[0], n):
                q_shape, s_shape = matvec.activation_shapes(n, cols)
                xq, xs = empty(q_shape, np.int8), empty(s_shape, np.int32)
                matvec.quantize(xq, xs, x, stream)

                def mine_all(ws=ws, out=out, workspace=workspace, quantized=(xq, xs)):
                    for w in ws:
                        linear_mma.linear_mma(out, w, quantized, None, stream, workspace)

                mine = time_in_graph(stream, mine_all, len(ws))
            skinny = None
            if skinny_gemm.supports(ws[0], n):
                xa = empty(skinny_gemm.activation_shape(n, cols), np.uint32)
                skinny_gemm.convert(xa, x, qtype, stream)

                def skinny_all(ws=ws, xa=xa, out=out, workspace=workspace):
                    for w in ws:
                        skinny_gemm.skinny_gemm(out, w, xa, None, stream, workspace)

                skinny = time_in_graph(stream, skinny_all, len(ws))

            def gemm_all(ws=ws, x=x, out=out, workspace=workspace):
                for w in ws:
                    gemm.gemm(out, w, x, None, stream, workspace)

            fp16 = time_in_graph(stream, gemm_all, len(ws))
            tile = "{}x{}".format(*gemm.choose_tile(n, rows))
            ratio = f"{mine / fp16:5.2f}" if mine is not None else "-"
            s = linear_mma.splits(rows, cols, n, sms) if mine is not None else "-"
            cells = "  ".join(f"{cell(us, nbytes):>{width}}" for us, width in ((mine, 18), (skinny, 16), (fp16, 16)))
            print(f"{f'{name} {rows}x{cols} {layout}':<24} {n:>4} {s:>6}  {cells}  {tile:>9}  {ratio:>11}")


if __name__ == "__main__":
    main()
