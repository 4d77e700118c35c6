"""Decode attention alone (`attention.paged_attention`, one new token a sequence) timed inside a CUDA graph, with the
KV bytes a launch reads per second (GPU machine).

    python scripts/bench_attention.py [--seqs 1,8,32,64] [--ctx 512,2048] [--shapes 30b-a3b,8b] [--ctas-per-sm 3]

Each graph launches the op on enough copies of the cache (one a "layer") to hold about twice the L2, back to back
with programmatic dependent launch as in a step, so a launch's time includes its share of the gaps. Every sequence
has --ctx keys in 16-key blocks placed at random in its copy's pool. --ctas-per-sm: values of
attention.DECODE_CTAS_PER_SM, the decode CTAs an SM is taken to hold at once ("occ": the occupancy calculator's
count, the engine's default), from which attention.decode_splits spreads a sequence's 64-key tiles over CTAs.
"""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import numpy as np
from bench_matvec import L2_BYTES, time_in_graph

from infero.backends.cuda import attention, runtime
from infero.backends.cuda.tensor import Workspace, empty, from_host

SHAPES = {"30b-a3b": (32, 4, 128), "8b": (32, 8, 128), "0.5b": (14, 2, 64)}  # query heads, kv heads, head dim
BLOCK_SIZE = 16


def layer(seqs: int, ctx: int, kv_heads: int, head_dim: int, rng) -> SimpleNamespace:
    blocks_per_seq = -(-ctx // BLOCK_SIZE)
    num_blocks = seqs * blocks_per_seq
    shape = (num_blocks, BLOCK_SIZE, kv_heads, head_dim)
    k = from_host(rng.normal(0, 1, size=shape).astype(np.float16))
    v = from_host(rng.normal(0, 1, size=shape).astype(np.float16))
    tables = rng.permutation(num_blocks).astype(np.int32).reshape(seqs, blocks_per_seq)
    return SimpleNamespace(k=k, v=v, tables=from_host(tables), bytes=2 * seqs * ctx * kv_heads * head_dim * 2)


def time_layers(stream, ws, layers, q, out, lens, starts, ctx: int) -> float:
    """Median microseconds of one decode attention launch (and its merge), over every layer's cache in one graph."""
    seqs, _, hd = q.shape

    def launch_all():
        for lay in layers:
            ws.offset = 0
            attention.paged_attention(out, q, lay.k, lay.v, lay.tables, lens, starts, hd**-0.5, 1, ctx, stream, ws,
                                      num_decode_seqs=seqs)  # fmt: skip

    launch_all()
    stream.synchronize()
    return time_in_graph(stream, launch_all, len(layers))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", default="1,8,32,64")
    parser.add_argument("--ctx", default="512,2048")
    parser.add_argument("--shapes", default="30b-a3b,8b")
    parser.add_argument("--ctas-per-sm", default="occ")
    args = parser.parse_args()
    rng, stream = np.random.default_rng(0), runtime.stream()
    ws = Workspace(attention.PARTIALS_BYTES + (1 << 20))
    print(f"{'shape':>8} {'seqs':>5} {'ctx':>6} {'ctas/SM':>7}  {'us':>8} {'GB/s':>7}")
    for shape in args.shapes.split(","):
        heads, kv_heads, hd = SHAPES[shape]
        for seqs in (int(s) for s in args.seqs.split(",")):
            for ctx in (int(c) for c in args.ctx.split(",")):
                first = layer(seqs, ctx, kv_heads, hd, rng)
                layers = [first] + [layer(seqs, ctx, kv_heads, hd, rng)
                                    for _ in range(max(1, -(-2 * L2_BYTES // first.bytes) - 1))]  # fmt: skip
                q = from_host(rng.normal(0, 1, size=(seqs, heads, hd)).astype(np.float32))
                out = empty((seqs, heads, hd), np.float32)
                lens = from_host(np.full(seqs, ctx, np.int32))
                starts = from_host(np.arange(seqs + 1, dtype=np.int32))
                for per_sm in (None if c == "occ" else int(c) for c in args.ctas_per_sm.split(",")):
                    attention.DECODE_CTAS_PER_SM = per_sm
                    us = time_layers(stream, ws, layers, q, out, lens, starts, ctx)
                    label = "occ" if per_sm is None else per_sm
                    print(f"{shape:>8} {seqs:>5} {ctx:>6} {label:>7}  {us:>8.1f} {first.bytes / us / 1e3:>7.0f}")


if __name__ == "__main__":
    main()
