"""matvec_mma_glu at 1, 2, 3 and 4 blocks an SM and at the 8B's 448 blocks (GPU): what one block alone on an SM
streams against an SM holding several, which bounds gate + up taking its extra groups of rows from a counter.

    python scripts/bench_glu_blocks.py

Q4_K gate and up of 32 rows a block x 4096 columns, tiled as the engine stores them, one token; each row count timed
in a graph of launches over copies past the L2 (PDL between them, as in the step), median of 3; µs a launch, the
launch's TB/s, GB/s an SM (over the SMs holding a block) and a block.
"""

from __future__ import annotations

import numpy as np
from bench_matvec import L2_BYTES, time_in_graph

from infero.backends.cuda import matvec, runtime, weight_layout
from infero.backends.cuda.tensor import empty, from_host
from infero.checkpoint.synthetic import random_blocks
from infero.checkpoint.tensor_types import GGMLType

Q4K = int(GGMLType.Q4_K)


def main() -> None:
    ctx, stream, rng = runtime.context(), runtime.stream(), np.random.default_rng(0)
    cols, n, sms = 4096, 1, ctx.info.num_sms
    x = from_host(rng.normal(0, 1, size=(n, cols)).astype(np.float32))
    q_shape, s_shape = matvec.activation_shapes(n, cols)
    xq, xs = empty(q_shape, np.int8), empty(s_shape, np.int32)
    matvec.quantize(xq, xs, x, stream)
    print(f"{'blocks':>7} {'per SM':>7} {'us':>8} {'TB/s':>6} {'GB/s an SM':>11} {'GB/s a block':>13}")
    for blocks in (sms, 2 * sms, 3 * sms, 448, 4 * sms):
        rows = 32 * blocks
        raw = random_blocks(Q4K, rows, cols, rng, 0.02)
        nbytes = 2 * raw.nbytes
        copies = max(2, -(-3 * L2_BYTES // nbytes))
        # gate and up: two allocations of the same bytes, so that up is not read from the L2 after gate
        pairs = [
            (weight_layout.upload(raw, Q4K, rows, cols), weight_layout.upload(raw, Q4K, rows, cols))
            for _ in range(copies)
        ]
        assert matvec.glu_fits(*pairs[0], n) and pairs[0][0].tiled
        out = empty((n, rows), np.float32)
        oq_shape, os_shape = matvec.activation_shapes(n, rows)
        oq, os_ = empty(oq_shape, np.int8), empty(os_shape, np.int32)

        def launch_all(pairs=pairs, out=out, oq=oq, os_=os_):
            for g, u in pairs:
                matvec.matvec_glu(out, g, u, x, (None, None), (xq, xs), (oq, os_), stream)

        launch_all()
        stream.synchronize()
        us = float(np.median([time_in_graph(stream, launch_all, copies) for _ in range(3)]))
        gb_s = nbytes / us / 1e3
        print(f"{blocks:>7} {blocks / sms:>7.2f} {us:>8.2f} {gb_s / 1e3:>6.2f} {gb_s / min(blocks, sms):>11.1f} "
              f"{gb_s / blocks:>13.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
