"""Mat-vec variants timed inside the whole decode step (GPU machine): for each mat-vec launch of a batch-1 decode
step, every compiled (rows per warp, prefetch depth) x warps per block in place of what `matvec.plan` picks, the
others left as planned; the step's GPU time (the engine's graph, CUDA events, median) for each.

    python scripts/sweep_decode_plan.py --model FILE.gguf [--steps 30]

`scripts/bench_matvec.py` times a matrix alone, back to back with copies of itself; inside a step each mat-vec
follows a norm, attention or SwiGLU and starts its weight loads during them (programmatic dependent launch), so
the variant that wins alone need not win there. The last lines put every launch's best variant in at once,
alternating with the planned launches: single step times drift by tens of microseconds between measurements.
"""

from __future__ import annotations

import argparse

import numpy as np

from infero import LLM
from infero.backends.cuda import matvec
from infero.bench.decode import graph_step_timer
from infero.checkpoint.tensor_types import GGMLType


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=8, help="alternations of the final best-vs-planned comparison")
    args = parser.parse_args()
    step_us = graph_step_timer(LLM(args.model, device="cuda"), args.prompt, args.steps)
    step_us()
    planned = {k: v for k, v in matvec._launches.items() if k[2] == 1 and k[0] not in matvec.MMA_ROW}
    header = f"{'launch (type rows x cols)':<30} {'planned':>12} {'planned us':>16} {'best':>14} {'best us':>9}"
    print(f"{header} {'gain us':>8}")
    best_all = {}
    for key, (fn, grid, block, *_) in sorted(planned.items(), key=lambda kv: -sum(kv[0][1])):
        t, rows, n, cols = key
        base = [step_us()]  # the planned launch, measured around the variants: the spread says what is noise
        results = []
        for rpw, ahead in matvec.N1_VARIANTS:
            warps = sum(-(-r // rpw) for r in rows)
            for wpb in (1, 2, 4):
                variant = matvec._kernel(f"matvec_q<{t}, 1, {rpw}, {ahead}>")
                launch = (variant, (-(-warps // wpb),), (32 * wpb,), 0, False)
                matvec._launches[key] = launch
                results.append((step_us(), (rpw, ahead, wpb), launch))
        matvec._launches[key] = (fn, grid, block, 0, False)
        base.append(step_us())
        us, variant, launch = min(results, key=lambda r: r[0])
        mean = sum(base) / 2
        if us < min(base):
            best_all[key] = launch
        expression = next(e for e, f in matvec._functions.items() if f is fn)
        name = f"{GGMLType(t).name} {'+'.join(map(str, rows))}x{cols}"
        planned_s = f"{expression[expression.index(',') + 5 : -1]}, {block[0] // 32}"
        spread = f"{base[0]:.1f}/{base[1]:.1f}"
        print(f"{name:<30} {planned_s:>12} {spread:>16} {str(variant):>14} {us:>9.1f} {mean - us:>8.1f}")
    # Both plans alternately, so that drift between measurements (tens of us) falls on both alike.
    as_planned, at_best = [], []
    for _ in range(args.repeats):
        matvec._launches.update(planned)
        as_planned.append(step_us())
        matvec._launches.update(best_all)
        at_best.append(step_us())
    print(f"every launch at its best: {' '.join(f'{v:.1f}' for v in at_best)} us (median {np.median(at_best):.1f})")
    print(
        f"as planned:               {' '.join(f'{v:.1f}' for v in as_planned)} us (median {np.median(as_planned):.1f})"
    )


if __name__ == "__main__":
    main()
