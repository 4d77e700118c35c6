"""Does a request's logits depend on who else shares its step? `infero bench invariance --model F`: the bitwise
promise of docs/kernels.md ("Batch invariance"), checked on this machine and backend.

One target sequence of random prompt ids; its logits rows computed every way the engine may compute them, each
compared bitwise with the reference (the whole prompt prefilled alone, eager):

    prefill in chunks of C      the prompt split into chunks of C tokens (C = 1: every token a decode step)
    decode, W sequences         the last prompt token as a decode step beside W - 1 other sequences' decodes
    decode + prefill of P       the same decode in a mixed step with another sequence's P-token prompt chunk
    graph, W sequences          the decode steps replayed from a CUDA graph instead of launched eagerly

Each case reports the rows compared, how many differ in any bit, and the largest difference relative to the row's
largest |logit|.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from infero.engine.batch import SequenceStep, build_batch

BLOCK = 16
CHUNKS = (1, 7, 64, 300)
WIDTHS = (2, 3, 4, 5, 8, 16, 17, 32, 33, 64)
MIXED = (1, 63, 100, 600)


@dataclass
class Case:
    name: str
    rows: int
    differ: int  # rows with any bit changed
    worst: float  # max |difference| / max |logit| over the rows


class _Cache:
    """The KV cache of one check: the blocks of each sequence's tokens (`sequences`), handed out in order."""

    def __init__(self, llm, sequences: list[int]):
        self.llm, self.next = llm, 0
        self.blocks = sum(-(-tokens // BLOCK) for tokens in sequences)
        self.kv = llm.backend.allocate_kv_cache(llm.model.config, self.blocks, BLOCK)

    def table(self, tokens: int) -> list[int]:
        n = -(-tokens // BLOCK)
        self.next += n
        assert self.next <= self.blocks
        return list(range(self.next - n, self.next))


def _run(llm, cache: _Cache, steps: list[SequenceStep]) -> np.ndarray:
    batch = build_batch(steps, BLOCK)
    result = llm.backend.forward(llm.model, batch, cache.kv)
    rows = len(batch.logits_indices)
    if rows == 0:
        return np.zeros((0, 0), np.float32)
    return result if isinstance(result, np.ndarray) else llm.backend.to_host(result, 0, rows)


def _case(name: str, got: np.ndarray, ref: np.ndarray) -> Case:
    differ = np.any(got != ref, axis=-1)
    scale = np.maximum(np.abs(ref).max(axis=-1), 1e-30)
    worst = float((np.abs(got.astype(np.float64) - ref).max(axis=-1) / scale).max())
    return Case(name, len(ref), int(differ.sum()), worst)


def check(llm, prompt_tokens: int = 300, chunks=CHUNKS, widths=WIDTHS, mixed=MIXED, seed: int = 0) -> list[Case]:
    """Every case above for one random prompt of prompt_tokens ids (chunks longer than the prompt are skipped)."""
    backend = llm.backend
    rng = np.random.default_rng(seed)
    vocab = llm.model.config.vocab_size
    n = prompt_tokens
    prompt = rng.integers(0, vocab, n).tolist()
    others = [rng.integers(0, vocab, int(rng.integers(20, 120))).tolist() for _ in range(max(widths) - 1)]
    cache = _Cache(llm, [n] + [len(o) + 1 for o in others] + [max(mixed)])
    graphs = hasattr(backend, "use_graphs")
    if graphs:
        backend.use_graphs = False

    target = cache.table(n)
    ref = _run(llm, cache, [SequenceStep(prompt, 0, target, "all")])
    cases = []
    for c in (c for c in chunks if c < n):
        rows = [_run(llm, cache, [SequenceStep(prompt[a : a + c], a, target, "all")]) for a in range(0, n, c)]
        cases.append(_case(f"prefill in chunks of {c}", np.concatenate(rows), ref))

    # The target's last token as a decode step (its first n - 1 tokens prefilled alone, as above), beside others.
    _run(llm, cache, [SequenceStep(prompt[:-1], 0, target, "none")])
    last = SequenceStep(prompt[-1:], n - 1, target, "last")
    alone = _run(llm, cache, [last])
    cases.append(_case("decode alone (vs the prefill's last row)", alone, ref[-1:]))
    tables = []
    for o in others:
        tables.append(cache.table(len(o) + 1))
        _run(llm, cache, [SequenceStep(o, 0, tables[-1], "none")])
    decodes = [
        SequenceStep([int(rng.integers(0, vocab))], len(o), t, "last") for o, t in zip(others, tables, strict=True)
    ]
    for w in widths:
        cases.append(_case(f"decode, {w} sequences", _run(llm, cache, [last] + decodes[: w - 1])[:1], alone))
    fresh = cache.table(max(mixed))
    for p in mixed:
        chunk = SequenceStep(rng.integers(0, vocab, p).tolist(), 0, fresh, "last")
        cases.append(_case(f"decode + prefill of {p}", _run(llm, cache, [last, chunk])[:1], alone))
    if graphs:
        backend.use_graphs = True
        for w in (1, 8, 32):
            got = _run(llm, cache, [last] + decodes[: w - 1])[:1]
            cases.append(_case(f"graph, {w} sequences", got, alone))
    return cases


def format_table(cases: list[Case]) -> str:
    lines = [f"{'case':<42} {'rows':>5} {'differ':>6} {'max |d| / max|logit|':>21}"]
    lines += [f"{c.name:<42} {c.rows:>5} {c.differ:>6} {c.worst:>21.2e}" for c in cases]
    return "\n".join(lines)


def add_arguments(p) -> None:
    p.add_argument("--prompt-tokens", type=int, default=300, metavar="N", help="tokens of the target's prompt")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")


def main(args) -> int:
    """The check's table; exit status 1 if any case differs."""
    from infero import LLM
    from infero.server.serve import batch_invariant

    llm = LLM(args.model, device=args.device, show_progress=True, batch_invariant=batch_invariant(args))
    cases = check(llm, args.prompt_tokens, seed=args.seed)
    print(f"{llm.config.name} ({llm.backend.name}): a {args.prompt_tokens}-token prompt")
    print(format_table(cases))
    return 0 if all(c.differ == 0 for c in cases) else 1
