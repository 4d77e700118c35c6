"""A layer's group of linears that read one activation (`CudaOps.linears`: q/k/v, or one matrix) at a few token
counts, as the engine dispatches them and with the skinny GEMM turned off (GPU machine), microseconds per group.

    python scripts/bench_linears.py [--n 4,8,16,24,32] [--groups qkv-q6,qkv,o]

qwen3-30b-a3b's attention matrices by default (q 4096x2048, k and v 512x2048, v Q6_K in half the layers; o
2048x4096). Columns: "as is" (the skinny GEMM from ops.SKINNY_MIN_TOKENS, a launch a matrix plus a conversion a
weight type and a reduce where it splits k), "no skinny" (the mat-vec in one launch per weight type up to 16
tokens, past it the fp16 GEMM a matrix), "slices" (past 16 tokens the mat-vec in slices of 16). Each timing is a
graph over copies of the group's weights past the L2, every call converting or quantizing its activation anew, as a
forward pass does once per activation.
"""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import numpy as np
from bench_linear_mma import weights_as_stored
from bench_matvec import time_in_graph

from infero.backends.cuda import ops, runtime
from infero.backends.cuda.ops import CudaOps
from infero.backends.cuda.tensor import Workspace, from_host
from infero.checkpoint.tensor_types import GGMLType

Q4, Q6 = int(GGMLType.Q4_K), int(GGMLType.Q6_K)
GROUPS = {
    "qkv-q6": [(Q4, 4096, 2048), (Q4, 512, 2048), (Q6, 512, 2048)],
    "qkv": [(Q4, 4096, 2048), (Q4, 512, 2048), (Q4, 512, 2048)],
    "o": [(Q4, 2048, 4096)],
}
MODES = ("as is", "no skinny", "slices")


def time_group(cuda_ops: CudaOps, stream, copies: list[list], x, mode: str) -> float:
    takes_skinny = CudaOps._takes_skinny
    n = x.shape[0]

    def run():
        for weights in copies:
            cuda_ops.ws.offset = 0
            cuda_ops.ws.generation += 1  # a new activation: converted or quantized again
            step = ops.MATVEC_MAX_TOKENS if mode == "slices" else n
            for a in range(0, n, step):
                cuda_ops.linears(x.rows(a, min(n, a + step)), weights)

    if mode != "as is":
        CudaOps._takes_skinny = lambda self, x, weight: False
    try:
        run()
        stream.synchronize()
        return time_in_graph(stream, run, len(copies))
    finally:
        CudaOps._takes_skinny = takes_skinny


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", default="4,8,16,24,32")
    parser.add_argument("--groups", default=",".join(GROUPS))
    args = parser.parse_args()
    rng, stream = np.random.default_rng(0), runtime.stream()
    backend = SimpleNamespace(workspace=Workspace(1 << 28), stream=stream, weights_arena=None, batch_invariant=False)
    cuda_ops = CudaOps(backend)
    widest = max(cols for specs in GROUPS.values() for _, _, cols in specs)
    cuda_ops.prepare(SimpleNamespace(hidden_size=widest, q_size=widest, intermediate_size=widest, ssm_inner_size=0,
                                     shared_expert_intermediate_size=0))  # fmt: skip
    print(f"{'group':<8} {'MB':>5} {'n':>3}  " + " ".join(f"{m:>10}" for m in MODES))
    for name in args.groups.split(","):
        specs = GROUPS[name]
        per_weight = [weights_as_stored(t, rows, cols, rng) for t, rows, cols in specs]
        copies = [list(group) for group in zip(*per_weight, strict=False)]
        megabytes = sum(w.data.nbytes for w in copies[0]) / 1e6
        for n in (int(v) for v in args.n.split(",")):
            x = from_host(rng.normal(0, 1, size=(n, specs[0][2])).astype(np.float32))
            times = [time_group(cuda_ops, stream, copies, x, mode) for mode in MODES]
            print(f"{name:<8} {megabytes:>5.1f} {n:>3}  " + " ".join(f"{t:>10.1f}" for t in times))


if __name__ == "__main__":
    main()
