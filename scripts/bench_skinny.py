"""Skinny GEMM vs what ran before it (GPU machine): for each K-quant shape and token count, skinny_gemm.cu timed
inside a CUDA graph next to the mat-vec (n <= 16) and the tile gemm.choose_tile picks, with weight GB/s.

    python scripts/bench_skinny.py [--shapes 8b] [--n 1,8,16,32,64]

As in bench_matvec.py, each graph launches on copies of the weight holding more bytes than the L2, back to back
with programmatic dependent launch; x is converted once outside the graph (a forward pass converts it once per
activation, not per matrix), while the GEMM's column includes its own per-call conversion.
"""

from __future__ import annotations

import argparse

import numpy as np
from bench_matvec import SHAPES, time_in_graph, weights_past_l2

from infero.backends.cuda import gemm, matvec, ops, runtime, skinny_gemm
from infero.backends.cuda.tensor import Workspace, empty, from_host
from infero.checkpoint.tensor_types import GGMLType


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="8b")
    parser.add_argument("--n", default="1,8,16,32,64")
    args = parser.parse_args()
    stream, rng, sms = runtime.stream(), np.random.default_rng(0), runtime.context().info.num_sms
    counts = [int(v) for v in args.n.split(",")]
    print(f"{'weight':<22} {'n':>3} {'splits':>6}  {'skinny us  GB/s':>16}  {'before us  GB/s':>16}  before")
    for name, rows, cols in (s for key in args.shapes.split(",") for s in SHAPES[key]):
        qtype = int(GGMLType[name])
        if qtype not in skinny_gemm.TYPES:
            continue
        ws = weights_past_l2(qtype, rows, cols, rng)
        nbytes = ws[0].data.nbytes
        for n in counts:
            x = from_host(rng.normal(0, 1, size=(n, cols)).astype(np.float32))
            out = empty((n, rows), np.float32)
            workspace = Workspace(skinny_gemm.MAX_SPLITS * n * rows * 4 + n * cols * 2 + (1 << 20))
            xa = empty(skinny_gemm.activation_shape(n, cols), np.uint32)
            skinny_gemm.convert(xa, x, qtype, stream)

            def skinny_all(ws=ws, xa=xa, out=out, workspace=workspace):
                for w in ws:
                    skinny_gemm.skinny_gemm(out, w, xa, None, stream, workspace)

            us = time_in_graph(stream, skinny_all, len(ws))
            if n <= ops.MATVEC_MAX_TOKENS:
                q_shape, s_shape = matvec.activation_shapes(n, cols)
                xq, xs = empty(q_shape, np.int8), empty(s_shape, np.int32)
                matvec.quantize(xq, xs, x, stream)

                def before_all(ws=ws, x=x, out=out, workspace=workspace, quantized=(xq, xs)):
                    for w in ws:
                        matvec.matvec(out, w, x, None, stream, workspace, quantized)

                label = "mat-vec"
            else:

                def before_all(ws=ws, x=x, out=out, workspace=workspace):
                    for w in ws:
                        gemm.gemm(out, w, x, None, stream, workspace)

                label = "gemm {}x{}".format(*gemm.choose_tile(n, rows))
            before = time_in_graph(stream, before_all, len(ws))
            s = skinny_gemm.splits(qtype, rows, cols, sms)
            print(f"{name + f' {rows}x{cols}':<22} {n:>3} {s:>6}  {us:7.1f} {nbytes / us / 1e3:6.0f}    "
                  f"{before:7.1f} {nbytes / before / 1e3:6.0f}    {label}")  # fmt: skip


if __name__ == "__main__":
    main()
