"""A mixture-of-experts layer's expert work on the GPU (`CudaOps.moe_experts`: sort, gate + up, SwiGLU, down, combine)
timed inside a CUDA graph at several token counts, per grouping variant (moe.GROUP_TOKENS pairs a group, moe.GROUP_RPW
rows a warp, on the __dp4a kernel; moe.MMA_GROUP pairs a group on the tensor cores, matvec_experts_mma), per pair
(moe.PAIR_RPW = moe.COMBINE_RPW rows a warp of matvec_experts and matvec_experts_combine) and on the fp16 tensor cores
(moe.FP16_EXPERTS: skinny_experts, runs from moe.fp16_run), with the bandwidth of the distinct chosen experts' bytes
(GPU machine).

    python scripts/bench_moe_experts.py [--n 1,8,32,512] [--variants 8x2,8x4,16x2] [--mma 16,32,64] [--experts 128]
                                        [--pair-rpw 2,4,8] [--fp16]

The layer has qwen3-30b-a3b's shape (hidden 2048, expert width 768; Q4_K gate and up, Q6_K down as Q4_K_M stores
them) with random bytes for weights (the kernels' time does not depend on the values) and uniformly random routing.
Every replay reads the experts from HBM (the layer's 390 MB are well past the L2). Variants other than the declared
one compile on first use.
"""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import numpy as np
from bench_matvec import time_in_graph

from infero.backends.cuda import moe, ops, runtime
from infero.backends.cuda.ops import CudaOps
from infero.backends.cuda.tensor import Workspace, from_host
from infero.checkpoint.tensor_types import BLOCK_LAYOUTS, GGMLType

HIDDEN, FFN = 2048, 768


def experts_tensor(t: GGMLType, experts: int, rows: int, cols: int, rng) -> moe.ExpertWeights:
    layout = BLOCK_LAYOUTS[t]
    raw = rng.integers(0, 256, size=(experts * rows, cols // layout.elements * layout.bytes), dtype=np.uint8)
    return moe.upload(raw, int(t), experts, rows, cols)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", default="1,8,32,512")
    parser.add_argument("--variants", default="8x2,8x4,16x2", help="GROUP_TOKENS x GROUP_RPW pairs")
    parser.add_argument("--mma", default="16,32,64", help="MMA_GROUP values (the tensor-core kernel's groups)")
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--pair-rpw", default="2,4,8", help="rows a warp of the pair-by-pair kernels")
    parser.add_argument("--fp16", action="store_true", help="also the fp16 expert kernel (moe.FP16_EXPERTS)")
    args = parser.parse_args()
    rng, stream = np.random.default_rng(0), runtime.stream()
    gate = experts_tensor(GGMLType.Q4_K, args.experts, FFN, HIDDEN, rng)
    up = experts_tensor(GGMLType.Q4_K, args.experts, FFN, HIDDEN, rng)
    down = experts_tensor(GGMLType.Q6_K, args.experts, HIDDEN, FFN, rng)
    per_expert = (gate.nbytes + up.nbytes + down.nbytes) / args.experts
    cuda_ops = CudaOps(SimpleNamespace(workspace=Workspace(1 << 30), stream=stream, weights_arena=None))
    variants = [tuple(int(v) for v in spec.split("x")) for spec in args.variants.split(",") if spec]
    mma_groups = [int(v) for v in args.mma.split(",") if v]
    switches = [(moe, "GROUP_TOKENS"), (moe, "GROUP_RPW"), (moe, "MMA_GROUP"), (ops, "MOE_GROUPED_MIN_TOKENS"),
                (ops, "MOE_MMA_MIN_TOKENS"), (moe, "PAIR_RPW"), (moe, "COMBINE_RPW"),
                (moe, "FP16_EXPERTS")]  # fmt: skip
    declared = [getattr(m, name) for m, name in switches]
    print(f"{'tokens':>6} {'experts read':>12}  {'variant':<18} {'us':>9} {'GB/s':>7}")
    for n in (int(v) for v in args.n.split(",")):
        h = from_host(rng.normal(0, 1, size=(n, HIDDEN)).astype(np.float32))
        ids = np.stack([rng.permutation(args.experts)[: args.k] for _ in range(n)]).astype(np.int32)
        weights = rng.dirichlet(np.ones(args.k), size=n).astype(np.float32)
        ids_d, weights_d = from_host(ids), from_host(weights)
        chosen = len(np.unique(ids))
        runs = [(f"per pair x{r}", "pair", int(r)) for r in args.pair_rpw.split(",") if r]
        runs += [(f"grouped {g}x{r}", "grouped", (g, r)) for g, r in variants]
        runs += [(f"tensor cores {g}", "mma", g) for g in mma_groups]
        if args.fp16:
            runs.append((f"fp16 runs of {moe.fp16_run(n * args.k, args.experts)}", "fp16", None))
        for label, kind, variant in runs:
            ops.MOE_MMA_MIN_TOKENS = n + 1
            if kind == "fp16":
                moe.FP16_EXPERTS = 1
            elif kind == "pair":
                ops.MOE_GROUPED_MIN_TOKENS = n + 1
                moe.PAIR_RPW = moe.COMBINE_RPW = variant
            elif n == 1:
                continue  # one token never groups
            else:
                ops.MOE_GROUPED_MIN_TOKENS = 2
                if kind == "mma":
                    ops.MOE_MMA_MIN_TOKENS, moe.MMA_GROUP = 2, variant
                else:
                    moe.GROUP_TOKENS, moe.GROUP_RPW = variant

            def layer(h=h, ids_d=ids_d, weights_d=weights_d):
                cuda_ops.ws.offset = 0
                cuda_ops.moe_experts(h, ids_d, weights_d, gate, up, down)

            layer()  # compiles an undeclared variant outside the capture
            stream.synchronize()
            us = time_in_graph(stream, layer, 1)
            print(f"{n:>6} {chosen:>12}  {label:<18} {us:>9.1f} {chosen * per_expert / us / 1e3:>7.0f}")
            for (m, name), value in zip(switches, declared, strict=True):
                setattr(m, name, value)


if __name__ == "__main__":
    main()
