"""The residual add + RMSNorm folded into a decode step's mat-vecs, kernel by kernel (GPU), one token:

    python scripts/bench_norm_fold.py

producer: matvec_norm (the projection with the add and the norm in its epilogue) against the plain mat-vec followed by
add_rms_norm; readers: matvec and matvec_glu on an activation whose norm they apply against the same launch on a plain
one. Each variant timed in a graph with PDL over weight copies past the L2 (bench_matvec.time_in_graph), the variants
alternating, median of 3; microseconds per launch (per mat-vec + norm pair for the unfolded producer).
"""

from __future__ import annotations

import numpy as np
from bench_matvec import time_in_graph, weights_past_l2

from infero.backends.cuda import driver, elementwise, matvec, runtime
from infero.backends.cuda.tensor import DeviceTensor, Workspace, empty, from_host
from infero.checkpoint.tensor_types import GGMLType

PRODUCERS = [("Q4_K", 4096, 4096), ("Q4_K", 4096, 14336), ("Q6_K", 4096, 14336)]  # the 8B's o and downs
READERS = [("Q4_K", 6144, 4096), ("Q4_K", 14336, 4096)]  # q/k/v's rows (one launch) and gate + up (matvec_glu)
EPS = 1e-5


def activation(n: int, cols: int, deferred: bool) -> matvec.Activation:
    """Activation buffers for n rows of cols, with room for a deferred norm's sums right after the scales."""
    q_shape, s_shape = matvec.activation_shapes(n, cols)
    s_and_sums = empty((int(np.prod(s_shape)) + n * cols // 32,), np.int32)
    s = DeviceTensor(s_and_sums.ptr, s_shape, np.dtype(np.int32), s_and_sums)
    if not deferred:
        return matvec.Activation(empty(q_shape, np.int8), s)
    sums = DeviceTensor(s.ptr + s.nbytes, (n, cols // 32), np.dtype(np.float32), s_and_sums)
    return matvec.Activation(empty(q_shape, np.int8), s, sums, EPS)


def main() -> None:
    stream, rng, n = runtime.stream(), np.random.default_rng(0), 1
    ws = Workspace(64 << 20)
    print(f"{'kernel':<34} {'plain us':>9} {'folded us':>10} {'diff':>7}")
    for name, rows, cols in PRODUCERS:
        copies = weights_past_l2(int(GGMLType[name]), rows, cols, rng)
        x = from_host(rng.normal(0, 1, size=(n, cols)).astype(np.float32))
        x_act = activation(n, cols, False)
        matvec.quantize(x_act.q, x_act.s, x, stream)
        residual = from_host(rng.normal(0, 1, size=(n, rows)).astype(np.float32))
        norm_weight = from_host(rng.uniform(0.5, 2, size=rows).astype(np.float32))
        y, h = empty((n, rows), np.float32), empty((n, rows), np.float32)
        plain_out, folded_out = activation(n, rows, False), activation(n, rows, True)

        def plain(copies=copies, x=x, x_act=x_act, y=y, h=h, residual=residual, norm_weight=norm_weight,
                  out=plain_out):  # fmt: skip
            for w in copies:
                matvec.matvec(y, w, x, None, stream, ws, x_act)
                elementwise.add_rms_norm(h, residual, y, norm_weight, EPS, stream, out)

        def folded(copies=copies, x=x, x_act=x_act, residual=residual, norm_weight=norm_weight, out=folded_out):
            for w in copies:
                matvec.matvec_norm(residual, w, x, x_act, norm_weight, out, stream)

        report(f"producer {name} {rows}x{cols}", plain, folded, len(copies), stream)
    for name, rows, cols in READERS:
        t = int(GGMLType[name])
        copies = weights_past_l2(t, rows, cols, rng)
        plain_act, deferred_act = activation(n, cols, False), activation(n, cols, True)
        y = from_host(rng.normal(0, 1, size=(n, cols)).astype(np.float32))
        for act in (plain_act, deferred_act):
            matvec.quantize(act.q, act.s, y, stream)
        sums = (rng.uniform(0.5, 2, size=(n, cols // 32)) * 32).astype(np.float32)
        driver.copy_host_to_device(deferred_act.norm_ss.ptr, sums)
        x, out = empty((n, cols), np.float32), empty((n, rows), np.float32)
        glu_out = activation(n, rows, False)

        def reader(act, copies=copies, x=x, out=out, glu_out=glu_out, rows=rows):
            if rows == 14336:
                for gate, up in zip(copies[::2], copies[1::2], strict=False):
                    matvec.matvec_glu(out, gate, up, x, (None, None), act, glu_out, stream)
            else:
                for w in copies:
                    matvec.matvec(out, w, x, None, stream, ws, act)

        label = f"reader {'glu ' if rows == 14336 else ''}{name} {rows}x{cols}"
        launches = len(copies) // 2 if rows == 14336 else len(copies)
        report(label, lambda r=reader, a=plain_act: r(a), lambda r=reader, a=deferred_act: r(a), launches, stream)


def report(label: str, plain, folded, launches: int, stream) -> None:
    times: dict[str, list[float]] = {"plain": [], "folded": []}
    for _ in range(3):
        times["plain"].append(time_in_graph(stream, plain, launches))
        times["folded"].append(time_in_graph(stream, folded, launches))
    a, b = (float(np.median(times[k])) for k in ("plain", "folded"))
    print(f"{label:<34} {a:>9.2f} {b:>10.2f} {b - a:>+7.2f}")


if __name__ == "__main__":
    main()
