"""Does a request's logits depend on who else shares its step? (GPU machine; issue 29's bitwise promise.)

One target sequence of random prompt ids; its logits rows computed every way the engine may compute them, each
compared bitwise with the reference (the whole prompt prefilled alone, eager):

    prefill in chunks of C      the prompt split into chunks of C tokens (C = 1: every token a decode step)
    decode, W sequences         the last prompt token as a decode step beside W - 1 other sequences' decodes
    decode + prefill of P       the same decode in a mixed step with another sequence's P-token prompt chunk
    graph                       the decode steps replayed from a CUDA graph instead of launched eagerly

    python scripts/batch_invariance.py --model F.gguf [--prompt-tokens 300] [--widths 2,3,4,8,16,17,32,64]

Prints per case the rows compared, how many differ in any bit, and the largest difference relative to the row's
largest |logit|. Exit status 1 if any case differs.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from infero import LLM
from infero.engine.batch import SequenceStep, build_batch

BLOCK = 16


class Cache:
    """The KV cache and its blocks handed out to the sequences of this script."""

    def __init__(self, llm: LLM, tokens: int):
        self.llm, self.next = llm, 0
        self.blocks = -(-tokens // BLOCK) + 8
        self.kv = llm.backend.allocate_kv_cache(llm.model.config, self.blocks, BLOCK)

    def table(self, tokens: int) -> list[int]:
        n = -(-tokens // BLOCK)
        self.next += n
        assert self.next <= self.blocks
        return list(range(self.next - n, self.next))


def run(llm: LLM, cache: Cache, steps: list[SequenceStep]) -> np.ndarray:
    batch = build_batch(steps, BLOCK)
    result = llm.backend.forward(llm.model, batch, cache.kv)
    rows = len(batch.logits_indices)
    if rows == 0:
        return np.zeros((0, 0), np.float32)
    return result if isinstance(result, np.ndarray) else llm.backend.to_host(result, 0, rows)


def compare(name: str, got: np.ndarray, ref: np.ndarray, table: list) -> bool:
    differ = np.any(got != ref, axis=-1)
    scale = np.maximum(np.abs(ref).max(axis=-1), 1e-30)
    worst = float((np.abs(got.astype(np.float64) - ref).max(axis=-1) / scale).max())
    table.append((name, len(ref), int(differ.sum()), worst))
    return not differ.any()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompt-tokens", type=int, default=300)
    ap.add_argument("--chunks", default="1,7,64,300")
    ap.add_argument("--widths", default="2,3,4,5,8,16,17,32,33,64")
    ap.add_argument("--mixed", default="1,63,100,600")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda", help="cpu: the same checks on the numpy backend")
    args = ap.parse_args()
    llm = LLM(args.model, device=args.device)
    backend = llm.backend
    rng = np.random.default_rng(args.seed)
    vocab = llm.model.config.vocab_size
    n = args.prompt_tokens
    prompt = rng.integers(0, vocab, n).tolist()
    widths = [int(w) for w in args.widths.split(",")]
    mixed = [int(p) for p in args.mixed.split(",")]
    others = [rng.integers(0, vocab, int(rng.integers(20, 120))).tolist() for _ in range(max(widths) - 1)]
    cache = Cache(llm, n * 3 + sum(len(o) + 1 for o in others) + max(mixed) + 64)
    graphs = hasattr(backend, "use_graphs")
    backend.use_graphs = False

    target = cache.table(n)
    ref = run(llm, cache, [SequenceStep(prompt, 0, target, "all")])
    table: list = []
    ok = True
    for c in (int(c) for c in args.chunks.split(",")):
        rows = [run(llm, cache, [SequenceStep(prompt[a : a + c], a, target, "all")]) for a in range(0, n, c)]
        ok &= compare(f"prefill in chunks of {c}", np.concatenate(rows), ref, table)

    # The target's last token as a decode step (its first n - 1 tokens prefilled alone, as above), beside others.
    run(llm, cache, [SequenceStep(prompt[:-1], 0, target, "none")])
    last = SequenceStep(prompt[-1:], n - 1, target, "last")
    alone = run(llm, cache, [last])
    ok &= compare("decode alone (vs the prefill's last row)", alone, ref[-1:], table)
    tables = []
    for o in others:
        tables.append(cache.table(len(o) + 1))
        run(llm, cache, [SequenceStep(o, 0, tables[-1], "none")])
    decodes = [
        SequenceStep([int(rng.integers(0, vocab))], len(o), t, "last") for o, t in zip(others, tables, strict=True)
    ]
    for w in widths:
        ok &= compare(f"decode, {w} sequences", run(llm, cache, [last] + decodes[: w - 1])[:1], alone, table)
    fresh = cache.table(max(mixed))
    for p in mixed:
        chunk = SequenceStep(rng.integers(0, vocab, p).tolist(), 0, fresh, "last")
        ok &= compare(f"decode + prefill of {p}", run(llm, cache, [last, chunk])[:1], alone, table)
    backend.use_graphs = True
    for w in (1, 8, 32) if graphs else ():
        got = run(llm, cache, [last] + decodes[: w - 1])[:1]
        ok &= compare(f"graph, {w} sequences", got, alone, table)

    print(f"{llm.model.config.architecture} {args.model}: {n}-token prompt")
    print(f"{'case':<42} {'rows':>5} {'differ':>6} {'max |d| / max|logit|':>21}")
    for name, rows, differ, worst in table:
        print(f"{name:<42} {rows:>5} {differ:>6} {worst:>21.2e}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
