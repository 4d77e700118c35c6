"""Skinny GEMM vs what ran before it (GPU machine): for each K-quant shape and token count, skinny_gemm.cu timed
inside a CUDA graph next to the mat-vec (n <= 16) and the tile gemm.choose_tile picks, with weight GB/s; at n <= 8
also skinny_gemv (the same bits streamed as a mat-vec), with how many of its outputs differ from skinny_gemm's in
any bit (0: the same numbers).

    python scripts/bench_skinny.py [--shapes 8b] [--n 1,8,16,32,64] [--tiled]

--tiled stores the Q4_K / Q6_K matrices as a model stores them (weight_layout.tiles), every kernel reading them so.

As in bench_matvec.py, each graph launches on copies of the weight holding more bytes than the L2, back to back
with programmatic dependent launch; x is converted once outside the graph (a forward pass converts it once per
activation, not per matrix), while the GEMM's column includes its own per-call conversion.
"""

from __future__ import annotations

import argparse

import numpy as np
from bench_matvec import SHAPES, time_in_graph, weights_past_l2

from infero.backends.cuda import gemm, matvec, ops, runtime, skinny_gemm, weight_layout
from infero.backends.cuda.tensor import Workspace, empty, from_host
from infero.checkpoint.tensor_types import GGMLType


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="8b")
    parser.add_argument("--n", default="1,8,16,32,64")
    parser.add_argument("--tiled", action="store_true", help="the tiled layout where a model would store it")
    args = parser.parse_args()
    stream, rng, sms = runtime.stream(), np.random.default_rng(0), runtime.context().info.num_sms
    counts = [int(v) for v in args.n.split(",")]
    print(f"{'weight':<22} {'n':>3} {'splits':>6}  {'skinny us  GB/s':>16}  {'gemv us  GB/s':>16} {'differ':>6}  "
          f"{'before us  GB/s':>16}  before")  # fmt: skip
    for name, rows, cols in (s for key in args.shapes.split(",") for s in SHAPES[key]):
        qtype = int(GGMLType[name])
        if qtype not in skinny_gemm.TYPES:
            continue
        ws = weights_past_l2(qtype, rows, cols, rng)
        if args.tiled and weight_layout.tiles(qtype, rows, cols):
            ws = [weight_layout.upload(w.data.to_host(), qtype, rows, cols) for w in ws]
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
            gemv_text = f"{'':>16} {'':>6}"
            if n <= skinny_gemm.GEMV_MAX_TOKENS:
                want = out.to_host()
                gemv_out = empty((n, rows), np.float32)

                def gemv_all(ws=ws, xa=xa, out=gemv_out, workspace=workspace):
                    for w in ws:
                        skinny_gemm.skinny_gemv(out, w, xa, None, stream, workspace)

                gemv_us = time_in_graph(stream, gemv_all, len(ws))
                differ = int((gemv_out.to_host().view(np.uint32) != want.view(np.uint32)).sum())
                gemv_text = f"{gemv_us:7.1f} {nbytes / gemv_us / 1e3:6.0f}    {differ:>6}"
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
            print(f"{name + f' {rows}x{cols}':<22} {n:>3} {s:>6}  {us:7.1f} {nbytes / us / 1e3:6.0f}    {gemv_text}  "
                  f"{before:7.1f} {nbytes / before / 1e3:6.0f}    {label}")  # fmt: skip


if __name__ == "__main__":
    main()
