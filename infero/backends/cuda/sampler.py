"""Sampling for the engine on the GPU: the step's logits stay on the device; only token ids (and logprobs where a
request asks for them) come back."""

from __future__ import annotations

from infero.backends.cuda.sampling import GpuSampler
from infero.engine.sampling import SampledTokens, SampleResult, SamplingParams


class CudaRowSampler:
    """Picks one token per sampled row of a step's device logits, by the numpy Sampler's rules and noise."""

    def __init__(self, backend, seed: int | None, vocab_size: int, max_rows: int):
        self.backend = backend
        self.max_rows = max_rows
        self.gpu = GpuSampler(vocab_size, max_rows, seed)

    def sample(self, logits, rows: list[int], params: list[SamplingParams], prompt_ids, output_ids,
               banned_token_ids=None, allowed_masks=None) -> list[SampleResult]:  # fmt: skip
        return self.launch(logits, rows, params, prompt_ids, output_ids, banned_token_ids, allowed_masks).results()

    def launch(self, logits, rows: list[int], params: list[SamplingParams], prompt_ids, output_ids,
               banned_token_ids=None, allowed_masks=None) -> SampledTokens:  # fmt: skip
        """sample(), queued on the backend's stream: the tokens stay on the device until results() is called."""
        n = len(rows)
        stream = self.backend.stream
        if n <= self.max_rows:
            step = self.gpu.pack(params, prompt_ids, output_ids, banned_token_ids, allowed_masks, rows)
            self.gpu.launch(logits, step, stream)
            return self.gpu.collect_async(step, stream)
        banned_token_ids = banned_token_ids or [None] * n
        allowed_masks = allowed_masks or [None] * n
        results = []
        # A step can sample more rows than the scratch holds (n > 1 siblings join their running batch in the
        # step their prompt completes): chunks in row order draw the same noise as one call would.
        for b in range(0, n, self.max_rows):
            e = b + self.max_rows
            results += self.gpu.sample(
                logits, params[b:e], prompt_ids[b:e], output_ids[b:e], banned_token_ids[b:e], allowed_masks[b:e],
                logit_rows=rows[b:e], stream=stream,
            )  # fmt: skip
        return SampledTokens(results)
