"""The numpy backend: reference ops, float32 KV blocks in host memory."""

from __future__ import annotations

import numpy as np

from infero.backends.cpu.ops import CpuHybridCache, CpuKVCache, CpuOps
from infero.backends.cpu.threads import requested_threads, set_blas_threads
from infero.checkpoint.config import ModelConfig
from infero.engine.batch import Batch, TokenFeed
from infero.engine.sampling import Sampler, SampleResult, SamplingParams

DEFAULT_KV_CACHE_BYTES = 1 << 30


class CpuBackend:
    name = "cpu"
    # A step's time grows with its tokens (~20-25 ms each in a long prompt on SmolLM2-135M, 2 cores, 1 BLAS thread,
    # over a 77 ms decode step): 16 bounds a running stream's gap at ~0.4 s while a long prompt is prefilled, for a
    # third of the prompt's prefill rate (measured in docs/performance.md, "CPU backend").
    default_max_num_batched_tokens = 16

    def __init__(self):
        self.ops = CpuOps()
        self.threads: int | None = None  # BLAS threads, set by prepare

    def kv_block_bytes(self, config: ModelConfig, block_size: int) -> int:
        """A block's K and V of every layer that keeps them (a hybrid model's full-attention layers only)."""
        layers = config.num_layers - config.num_recurrent_layers
        return CpuKVCache.bytes_per_block(layers, block_size, config.num_kv_heads, config.head_dim)

    def state_bytes_per_slot(self, config: ModelConfig) -> int:
        """One sequence's recurrent state (a hybrid model's Gated DeltaNet layers); 0 for other models."""
        return CpuHybridCache.bytes_per_slot(config) if config.is_hybrid else 0

    def prepare(self, config: ModelConfig, engine_config) -> None:
        """Set the BLAS thread count; nothing to preallocate (numpy allocates per op)."""
        self.threads = requested_threads(engine_config.cpu_threads)
        set_blas_threads(self.threads)

    def kv_cache_bytes(self, engine_config) -> int:
        return engine_config.kv_cache_bytes or DEFAULT_KV_CACHE_BYTES

    def allocate_kv_cache(self, config: ModelConfig, num_blocks: int, block_size: int,
                          num_state_slots: int = 0) -> CpuKVCache:  # fmt: skip
        """KV blocks, and for a hybrid model the recurrent state of num_state_slots sequences beside them."""
        if config.is_hybrid:
            return CpuHybridCache(config, num_blocks, block_size, num_state_slots)
        return CpuKVCache(config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim)

    def sampler(self, seed: int | None) -> RowSampler:
        return RowSampler(seed)

    def to_host(self, logits: np.ndarray, start: int, stop: int) -> np.ndarray:
        return logits[start:stop]

    def copy_bandwidth(self, nbytes: int = 1 << 28, repeats: int = 5) -> float:
        """Host memory bandwidth in bytes/s, counting bytes read plus bytes written (median of repeats)."""
        import time

        src = np.ones(nbytes // 4, np.float32)
        dst = np.empty_like(src)
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            np.copyto(dst, src)
            times.append(time.perf_counter() - t)
        return 2 * nbytes / float(np.median(times))

    def copy_blocks(self, cache: CpuKVCache, pairs: list[tuple[int, int]]) -> None:
        """Copy whole KV blocks (every layer) from src to dst, for sequences that fork."""
        src, dst = [s for s, _ in pairs], [d for _, d in pairs]
        for k, v in zip(cache.k, cache.v, strict=True):
            k[dst], v[dst] = k[src], v[src]

    def copy_state(self, cache: CpuHybridCache, src_slot: int, dst_slot: int) -> None:
        """Copy a slot's whole recurrent state (every recurrent layer) to another, for sequences that fork."""
        cache.conv[dst_slot] = cache.conv[src_slot]
        cache.delta[dst_slot] = cache.delta[src_slot]

    def forward(self, model, batch: Batch, cache: CpuKVCache, feed: TokenFeed | None = None) -> np.ndarray:
        """float32 logits [len(batch.logits_indices), vocab]; feed: input tokens still to come from the last
        sampling (here always on the host already).

        One pass for the whole batch, so a step reads each weight once however many sequences it holds. Every op
        computes a row the same way whatever the other rows are (see CpuOps.linear; attention runs per
        sequence), so a sequence's numbers never depend on which others share its step: tests pin this.
        """
        if feed is not None:
            batch = feed.resolve(batch)
        return model.forward(batch, cache)


class RowSampler:
    """The numpy Sampler applied to chosen rows of a step's logits (a row may be sampled by several sequences)."""

    def __init__(self, seed: int | None):
        self.sampler = Sampler(seed)

    def sample(self, logits: np.ndarray, rows: list[int], params: list[SamplingParams], prompt_ids, output_ids,
               banned_token_ids=None, allowed_masks=None) -> list[SampleResult]:  # fmt: skip
        return self.sampler.sample(logits[rows], params, prompt_ids, output_ids, banned_token_ids, allowed_masks)
