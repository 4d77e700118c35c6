"""The numpy backend: reference ops, float32 KV blocks in host memory, one sequence at a time."""

from __future__ import annotations

import numpy as np

from infero.backends.cpu.ops import CpuKVCache, CpuOps
from infero.checkpoint.config import ModelConfig
from infero.engine.batch import Batch


class CpuBackend:
    name = "cpu"

    def __init__(self):
        self.ops = CpuOps()

    def kv_block_bytes(self, config: ModelConfig, block_size: int) -> int:
        return CpuKVCache.bytes_per_block(config.num_layers, block_size, config.num_kv_heads, config.head_dim)

    def allocate_kv_cache(self, config: ModelConfig, num_blocks: int, block_size: int) -> CpuKVCache:
        return CpuKVCache(config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim)

    def copy_blocks(self, cache: CpuKVCache, pairs: list[tuple[int, int]]) -> None:
        """Copy whole KV blocks (every layer) from src to dst, for sequences that fork."""
        src, dst = [s for s, _ in pairs], [d for _, d in pairs]
        for k, v in zip(cache.k, cache.v, strict=True):
            k[dst], v[dst] = k[src], v[src]

    def forward(self, model, batch: Batch, cache: CpuKVCache) -> np.ndarray:
        """float32 logits [len(batch.logits_indices), vocab].

        Each sequence runs as its own forward pass, so the matrix shapes (and BLAS's summation order) a sequence
        sees never depend on which other sequences share the step: batch invariance by construction.
        """
        if batch.num_seqs == 1:
            return model.forward(batch, cache)
        parts = [model.forward(batch.sequence(i), cache) for i in range(batch.num_seqs)]
        return np.concatenate(parts, axis=0)
