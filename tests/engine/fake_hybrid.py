"""A stand-in hybrid model for the engine's tests: all of it recurrent state, so its tokens depend on every token
before them only through the state slot the engine gives each sequence. A slot that leaked another sequence's
state, a fork that did not copy its parent's, or a step that ran a sequence in the wrong slot changes the tokens.

The model checks what the batch interface promises (tests/engine/test_hybrid_engine.py relies on it): every
sequence has a slot, no two sequences of a step share one, and a sequence that starts at position 0 has its slot
zeroed first (the real models do the same).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from infero.backends.cpu import CpuBackend
from infero.engine.batch import Batch
from infero.engine.engine import Engine, EngineConfig

STATE = 32  # floats per slot
KV_BLOCK_BYTES = 1024  # what the stand-in says a KV block costs (it keeps no K/V)


@dataclass(frozen=True)
class HybridConfig:
    vocab_size: int
    context_length: int = 256
    is_hybrid: bool = True


class FakeCache:
    def __init__(self, num_blocks: int, num_state_slots: int):
        self.num_blocks = num_blocks
        self.state = np.full((num_state_slots, STATE), np.nan)  # garbage until a sequence's first step zeroes it


class HybridModel:
    """state <- tanh(state @ A + E[token]) token by token; logits = state @ W. float64, one order: a sequence's
    numbers are the same however its prompt is chunked and whatever shares its step."""

    prefill_alignment = 1

    def __init__(self, vocab_size: int, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.config = HybridConfig(vocab_size)
        self.a = rng.normal(0, 0.5, (STATE, STATE))
        self.e = rng.normal(0, 1.0, (vocab_size, STATE))
        self.w = rng.normal(0, 2.0, (STATE, vocab_size))

    def forward(self, batch: Batch, cache: FakeCache) -> np.ndarray:
        slots = batch.state_slots.tolist()
        assert min(slots) >= 0, f"a sequence without a state slot: {slots}"
        assert len(set(slots)) == len(slots), f"two sequences of one step share a state slot: {slots}"
        rows = np.empty((batch.num_tokens, STATE))
        starts = batch.query_starts
        for i, slot in enumerate(slots):
            a, b = int(starts[i]), int(starts[i + 1])
            if batch.positions[a] == 0:
                cache.state[slot] = 0.0
            for t in range(a, b):
                cache.state[slot] = np.tanh(cache.state[slot] @ self.a + self.e[batch.token_ids[t]])
                rows[t] = cache.state[slot]
        return (rows[batch.logits_indices] @ self.w).astype(np.float32)


class HybridBackend(CpuBackend):
    """The CPU backend's sampler and threads around the stand-in's cache; records the state copies of forks."""

    def __init__(self):
        super().__init__()
        self.state_copies: list[tuple[int, int]] = []

    def kv_block_bytes(self, config, block_size: int) -> int:
        return KV_BLOCK_BYTES

    def state_bytes_per_slot(self, config) -> int:
        return STATE * 8

    def allocate_kv_cache(self, config, num_blocks: int, block_size: int, num_state_slots: int = 0) -> FakeCache:
        return FakeCache(num_blocks, num_state_slots)

    def copy_blocks(self, cache: FakeCache, pairs: list[tuple[int, int]]) -> None:
        pass  # the stand-in keeps no K/V

    def copy_state(self, cache: FakeCache, src_slot: int, dst_slot: int) -> None:
        self.state_copies.append((src_slot, dst_slot))
        cache.state[dst_slot] = cache.state[src_slot]


def hybrid_engine(tokenizer, **config) -> Engine:
    model = HybridModel(tokenizer.vocab_size)
    return Engine(model, HybridBackend(), tokenizer, EngineConfig(**config))
