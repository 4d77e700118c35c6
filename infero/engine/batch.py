"""Batch: the tokens of one forward step, for several sequences, over a paged KV cache.

Every sequence contributes `query_lens[i]` new tokens (a prefill chunk, or 1 for a decode) that attend to
the `context_lens[i] - query_lens[i]` tokens already in its cache blocks and, causally, to each other.
A hybrid model's recurrent layers carry one state per sequence instead, in the slot `state_slots[i]`; a sequence
whose tokens start at position 0 is fresh, and the model zeroes its slot first (a recycled slot, or a preempted
request recomputed from its start, never sees an earlier sequence's state).
This is the interface the scheduler fills and every backend (numpy, CUDA) consumes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from infero.engine.sampling import SampledTokens


@dataclass(frozen=True)
class Batch:
    token_ids: np.ndarray  # int32 [num_tokens]: all sequences' new tokens, sequence after sequence
    positions: np.ndarray  # int32 [num_tokens]: position of each token in its sequence
    query_lens: np.ndarray  # int32 [num_seqs]: new tokens per sequence
    context_lens: np.ndarray  # int32 [num_seqs]: tokens in the sequence's cache once this step has run
    block_tables: np.ndarray  # int32 [num_seqs, max_blocks]: cache block ids per sequence, unused entries -1
    slot_mapping: np.ndarray  # int64 [num_tokens]: cache slot (block * block_size + offset) for each new token
    logits_indices: np.ndarray  # int32 [num_logits]: rows of num_tokens whose logits the step returns
    state_slots: np.ndarray  # int32 [num_seqs]: each sequence's recurrent-state slot (hybrid models), else -1

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.query_lens.shape[0])

    @property
    def query_starts(self) -> np.ndarray:
        """int32 [num_seqs + 1]: where each sequence's tokens begin in the flat token arrays."""
        return np.concatenate([[0], np.cumsum(self.query_lens)]).astype(np.int32)


@dataclass(frozen=True)
class TokenFeed:
    """Input tokens a step takes from the sampling of the step before it, launched before the host has seen them
    (asynchronous scheduling): token i of the batch is row rows[i] of `sampled` (rows[i] < 0: batch.token_ids[i])."""

    sampled: SampledTokens
    rows: np.ndarray  # int32 [num_tokens]

    def resolve(self, batch: Batch) -> Batch:
        """The batch with the fed tokens filled in on the host (waits for the sampling): for a backend whose
        sampled tokens are not on the device (sampled.device_tokens is None)."""
        fed = self.rows >= 0
        token_ids = batch.token_ids.copy()
        token_ids[fed] = self.sampled.token_ids()[self.rows[fed]]
        return dataclasses.replace(batch, token_ids=token_ids)


@dataclass(frozen=True)
class SequenceStep:
    """What one sequence runs in a step: its new tokens and where its cache lives."""

    token_ids: list[int]
    start_position: int  # tokens already in the cache
    block_table: list[int]
    logits: str = "last"  # last | all | none
    state_slot: int = -1  # the sequence's recurrent-state slot (hybrid models); -1: none


def build_batch(steps: list[SequenceStep], block_size: int) -> Batch:
    """Flatten per-sequence steps into a Batch (positions, slot mapping, padded block tables)."""
    token_ids, positions, slots, logits_indices = [], [], [], []
    query_lens, context_lens = [], []
    offset = 0
    for step in steps:
        n = len(step.token_ids)
        if len(step.block_table) * block_size < step.start_position + n:
            raise ValueError(
                f"block table of {len(step.block_table)} blocks cannot hold {step.start_position + n} tokens"
            )
        token_ids.extend(step.token_ids)
        if n == 1:  # a decode: plain integers (numpy's per-call cost dominates a one-token step)
            p = step.start_position
            positions.append(p)
            slots.append(step.block_table[p // block_size] * block_size + p % block_size)
        else:
            pos = np.arange(step.start_position, step.start_position + n, dtype=np.int64)
            table = np.asarray(step.block_table, dtype=np.int64)
            positions.extend(pos.tolist())
            slots.extend((table[pos // block_size] * block_size + pos % block_size).tolist())
        if step.logits == "all":
            logits_indices.extend(range(offset, offset + n))
        elif step.logits == "last" and n:
            logits_indices.append(offset + n - 1)
        query_lens.append(n)
        context_lens.append(step.start_position + n)
        offset += n
    max_blocks = max((len(s.block_table) for s in steps), default=0)
    tables = np.full((len(steps), max(max_blocks, 1)), -1, dtype=np.int32)
    for i, step in enumerate(steps):
        tables[i, : len(step.block_table)] = step.block_table
    return Batch(
        token_ids=np.asarray(token_ids, dtype=np.int32),
        positions=np.asarray(positions, dtype=np.int32),
        query_lens=np.asarray(query_lens, dtype=np.int32),
        context_lens=np.asarray(context_lens, dtype=np.int32),
        block_tables=tables,
        slot_mapping=np.asarray(slots, dtype=np.int64),
        logits_indices=np.asarray(logits_indices, dtype=np.int32),
        state_slots=np.asarray([s.state_slot for s in steps], dtype=np.int32),
    )
