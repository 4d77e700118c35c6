"""A model's Q4_K and Q6_K linear layers tiled (weight_layout.py) against the same model in GGUF rows (or only its
matrices of the types named by --rows) inside the batch-1
decode step (GPU machine): both loaded in one process, first checked bitwise (the logits of prefills, which the
GEMM runs, of a step of 3 sequences (the skinny GEMM) and of decode steps (the fused mat-vecs)), then their steps'
GPU times alternated (bench/decode.py's graph_step_timer), so that the drift between measurements falls on
both alike.

    python scripts/ab_layout.py --model FILE.gguf [--rows Q6_K] [--repeats 8]
"""

from __future__ import annotations

import argparse
import copy

import numpy as np

from infero import LLM
from infero.backends.cuda import weight_layout
from infero.bench.decode import BLOCK_SIZE, graph_step_timer
from infero.checkpoint.tensor_types import GGMLType
from infero.engine.batch import SequenceStep, build_batch
from infero.engine.engine import EngineConfig
from infero.models import load_model


def rows_copy(llm: LLM, types: set[int] | None) -> LLM:
    """llm with its model loaded again, its matrices of these types (None: all) in GGUF rows."""
    tiles = weight_layout.tiles
    weight_layout.tiles = lambda t, rows, cols: types is not None and t not in types and tiles(t, rows, cols)
    try:
        other = copy.copy(llm)
        other.model = load_model(llm.checkpoint, llm.backend.ops)
    finally:
        weight_layout.tiles = tiles
    return other


def logits(llm: LLM, ids: list[int]) -> list[np.ndarray]:
    """The logits of three 100-token prefills (the GEMM), of a step of the three sequences' next tokens (the skinny
    GEMM), then of two decode steps of the first (the fused mat-vecs)."""
    model, backend = llm.model, llm.backend
    cache = backend.allocate_kv_cache(model.config, 24, BLOCK_SIZE)
    tables = [list(range(8 * i, 8 * i + 8)) for i in range(3)]
    prompts = [ids[5 * i : 5 * i + 101] for i in range(3)]

    def run(steps: list[SequenceStep]) -> np.ndarray:
        return backend.to_host(backend.forward(model, build_batch(steps, BLOCK_SIZE), cache), 0, len(steps))

    out = [run([SequenceStep(p[:100], 0, t)]) for p, t in zip(prompts, tables, strict=True)]
    out.append(run([SequenceStep(p[100:], 100, t) for p, t in zip(prompts, tables, strict=True)]))
    out += [run([SequenceStep([ids[120 + i]], 101 + i, tables[0])]) for i in range(2)]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--rows", help="comma-separated types the other model keeps in rows (default: all)")
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    tiled = LLM(args.model, device="cuda", engine_config=EngineConfig(kv_cache_bytes=1 << 30))
    types = None if args.rows is None else {int(GGMLType[name]) for name in args.rows.split(",")}
    rows = rows_copy(tiled, types)
    for name, llm in (("tiled", tiled), ("rows", rows)):
        layer = llm.model.layers[0]
        count = sum(w.tiled for w in (layer.wq, layer.wk, layer.wv, layer.wo, layer.w_gate, layer.w_up, layer.w_down))
        print(f"{name}: layer 0 has {count} of 7 matrices tiled; the head tiled: {llm.model.output.tiled}")
    ids = np.random.default_rng(0).integers(0, tiled.config.vocab_size, size=130).tolist()
    for i, (a, b) in enumerate(zip(logits(tiled, ids), logits(rows, ids), strict=True)):
        if not np.array_equal(a.view(np.uint32), b.view(np.uint32)):
            raise SystemExit(f"logits {i}: the tiled model's differ from the GGUF rows' (max |diff| "
                             f"{np.abs(a - b).max():.3e})")  # fmt: skip
    print("logits bitwise the same (3 prefills, a 3-sequence step, 2 decode steps)")
    timers = {"rows": graph_step_timer(rows, steps=args.steps), "tiled": graph_step_timer(tiled, steps=args.steps)}
    for timer in timers.values():
        timer()
    times: dict[str, list[float]] = {name: [] for name in timers}
    for _ in range(args.repeats):
        for name, timer in timers.items():
            times[name].append(timer())
    diffs = np.array(times["tiled"]) - np.array(times["rows"])
    for name, values in times.items():
        print(f"{name:<6} step {np.median(values):9.1f} us  ({' '.join(f'{v:.1f}' for v in values)})")
    print(f"tiled - rows: median {np.median(diffs):+.1f} us, {int((diffs < 0).sum())} of {len(diffs)} pairs lower")


if __name__ == "__main__":
    main()
