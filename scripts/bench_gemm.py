"""GEMM tile sweep for small batches (GPU machine): for each weight shape and token count, every block tile of
gemm.cu (and a 16 x 64 candidate) timed inside a CUDA graph, next to the tile gemm.choose_tile picks.

    python scripts/bench_gemm.py [--shapes 8b,0.5b] [--n 8,17,32,64]

As in bench_matvec.py, each graph runs the launch pair (x to fp16, GEMM) on copies of the weight holding more
bytes than the L2, so a launch's time includes its share of the gaps; the GB/s column is weight bytes per second.
"""

from __future__ import annotations

import argparse

import numpy as np
from bench_matvec import SHAPES, time_in_graph, weights_past_l2

from infero.backends.cuda import gemm, runtime
from infero.backends.cuda.tensor import Workspace, empty, from_host
from infero.checkpoint.tensor_types import GGMLType

CANDIDATES = gemm.TILES + ((16, 64),)


def time_tile(stream, ws, x, out, workspace, tile) -> float:
    def launch_all():
        for w in ws:
            gemm.gemm(out, w, x, None, stream, workspace, tile=tile)

    return time_in_graph(stream, launch_all, len(ws), replays=5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="8b")
    parser.add_argument("--n", default="8,17,32,64")
    args = parser.parse_args()
    stream, rng = runtime.stream(), np.random.default_rng(0)
    counts = [int(v) for v in args.n.split(",")]
    print(f"{'weight':<22} {'n':>4}  " + "  ".join(f"{f'{bm}x{bn} us':>12}" for bm, bn in CANDIDATES) + "  chosen")
    for name, rows, cols in (s for key in args.shapes.split(",") for s in SHAPES[key]):
        qtype = int(GGMLType[name])
        ws = weights_past_l2(qtype, rows, cols, rng)
        nbytes = ws[0].data.nbytes
        for n in counts:
            x = from_host(rng.normal(0, 1, size=(n, cols)).astype(np.float32))
            out = empty((n, rows), np.float32)
            workspace = Workspace(n * cols * 2 + (1 << 20))
            cells = []
            for tile in CANDIDATES:
                us = time_tile(stream, ws, x, out, workspace, tile)
                cells.append(f"{us:7.1f} {nbytes / us / 1e3:4.0f}")
            chosen = gemm.choose_tile(n, rows)
            print(f"{name + f' {rows}x{cols}':<22} {n:>4}  " + "  ".join(cells) + f"  {chosen[0]}x{chosen[1]}")


if __name__ == "__main__":
    main()
