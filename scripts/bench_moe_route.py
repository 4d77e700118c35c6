"""A mixture-of-experts layer's routing on the GPU (`CudaOps.moe_route`: the float32 router's logits by
moe_router, then moe_route's softmax and top-k; up to moe.ROUTER_WARPS tokens both in one launch) timed inside a CUDA
graph at several token counts, each launch alone and the op (GPU machine).

    python scripts/bench_moe_route.py [--n 1,4,8,32,128,512,2048] [--experts 128] [--k 8] [--hidden 2048]
                                      [--tiles-min 1,100000]

qwen3-30b-a3b's shape by default (hidden 2048, 128 experts, 8 chosen); qwen3.5-35b-a3b's is --experts 256
--shared (a 257th router row, the shared expert's gate). --tiles-min: values of moe.ROUTER_TILES_MIN_TOKENS, the
rows from which the logits take moe_router_tiles instead of moe_router (a row each).
"""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import numpy as np
from bench_matvec import time_in_graph

from infero.backends.cuda import moe, runtime
from infero.backends.cuda.ops import CudaOps
from infero.backends.cuda.tensor import QuantWeight, Workspace, empty, from_host


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", default="1,4,8,32,128,512,2048")
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--shared", action="store_true", help="a shared expert's gate as the router's last row")
    parser.add_argument("--tiles-min", default=str(moe.ROUTER_TILES_MIN_TOKENS))
    args = parser.parse_args()
    rng, stream = np.random.default_rng(0), runtime.stream()
    rows = args.experts + args.shared
    w = rng.normal(0, 0.05, size=(rows, args.hidden)).astype(np.float32)
    router = QuantWeight(from_host(w.view(np.uint8).reshape(rows, 4 * args.hidden)), 0, rows, args.hidden)
    cuda_ops = CudaOps(SimpleNamespace(workspace=Workspace(1 << 28), stream=stream, weights_arena=None))
    print(f"{'tokens':>6} {'tiles from':>10}  {'router us':>10} {'route us':>9} {'op us':>8}")
    for n, tiles_min in ((int(v), int(m)) for v in args.n.split(",") for m in args.tiles_min.split(",")):
        moe.ROUTER_TILES_MIN_TOKENS = tiles_min
        h = from_host(rng.normal(0, 1, size=(n, args.hidden)).astype(np.float32))
        logits = empty((n, rows), np.float32)
        ids, weights = empty((n, args.k + args.shared), np.int32), empty((n, args.k + args.shared), np.float32)

        def op(h=h):
            cuda_ops.ws.offset = 0
            cuda_ops.moe_route(h, router, args.k, args.shared)

        def router_only(h=h, logits=logits):
            moe.router(logits, h, router, stream)

        def route_only(logits=logits, ids=ids, weights=weights):
            moe.route(ids, weights, logits, stream, args.shared)

        times = []
        for fn in (router_only, route_only, op):
            fn()  # loads the kernels outside the capture
            stream.synchronize()
            times.append(time_in_graph(stream, fn, 1))
        print(f"{n:>6} {tiles_min:>10}  {times[0]:>10.1f} {times[1]:>9.1f} {times[2]:>8.1f}")


if __name__ == "__main__":
    main()
