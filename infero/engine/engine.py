"""The engine: add_request / step / abort over a scheduler, a model on a backend, and a sampler.

One step = schedule, run one batched forward, sample, then turn new tokens into text and decide who is done.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from infero.engine.batch import SequenceStep, build_batch
from infero.engine.kv_cache import DEFAULT_BLOCK_SIZE, BlockPool
from infero.engine.request import Request, RequestOutput, TokenLogprob
from infero.engine.sampling import Sampler, SamplingParams
from infero.engine.scheduler import ScheduledChunk, Scheduler
from infero.engine.stop import StopChecker
from infero.errors import InferoError, PromptTooLongError
from infero.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass(frozen=True)
class EngineConfig:
    max_model_len: int | None = None  # defaults to the model's context length
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    block_size: int = DEFAULT_BLOCK_SIZE
    kv_cache_bytes: int = 1 << 30  # CPU backend: the KV pool's byte budget
    seed: int | None = None  # for requests without their own seed


class Engine:
    def __init__(self, model, backend, tokenizer: Tokenizer, config: EngineConfig = EngineConfig()):
        self.model, self.backend, self.tokenizer, self.config = model, backend, tokenizer, config
        mc = model.config
        num_blocks = config.kv_cache_bytes // backend.kv_block_bytes(mc, config.block_size)
        if num_blocks < 1:
            raise InferoError(f"KV cache budget of {config.kv_cache_bytes} bytes holds no block")
        self.pool = BlockPool(num_blocks, config.block_size)
        self.cache = backend.allocate_kv_cache(mc, num_blocks, config.block_size)
        self.max_model_len = min(
            config.max_model_len or mc.context_length, mc.context_length, num_blocks * config.block_size
        )
        self.scheduler = Scheduler(self.pool, config.max_num_seqs, config.max_num_batched_tokens)
        self.sampler = Sampler(config.seed)
        self._requests: dict[str, _Tracked] = {}
        self._arrivals = itertools.count()

    @property
    def kv_capacity_tokens(self) -> int:
        return self.pool.num_blocks * self.pool.block_size

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        if request_id in self._requests:
            raise InferoError(f"request id {request_id!r} is already running")
        if not prompt_ids:
            raise InferoError("the prompt is empty")
        vocab = self.model.config.vocab_size
        if max(prompt_ids) >= vocab or min(prompt_ids) < 0:
            raise InferoError(f"prompt token ids must lie in [0, {vocab})")
        if len(prompt_ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"the prompt has {len(prompt_ids)} tokens; this model's context holds {self.max_model_len} "
                "including at least one generated token"
            )
        req = Request(request_id, list(prompt_ids), params, next(self._arrivals))
        detok = IncrementalDetokenizer(
            self.tokenizer, skip_special_tokens=params.skip_special_tokens, prompt_ids=req.prompt_ids
        )
        self._requests[request_id] = _Tracked(req, detok, StopChecker(params.stop))
        self.scheduler.add(req)

    def abort(self, request_id: str) -> None:
        tracked = self._requests.pop(request_id, None)
        if tracked is not None and not tracked.request.finished:
            self.scheduler.finish(tracked.request, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        chunks = self.scheduler.schedule()
        if not chunks:
            return []
        steps = [self._sequence_step(c) for c in chunks]
        logits = self.backend.forward(self.model, build_batch(steps, self.pool.block_size), self.cache)
        sampling = [c for c in chunks if c.completes_prompt]
        for c in chunks:
            c.request.num_computed_tokens += c.num_tokens
        if not sampling:
            return []
        reqs = [c.request for c in sampling]
        results = self.sampler.sample(
            np.asarray(logits, dtype=np.float32),
            [r.params for r in reqs],
            [r.prompt_ids for r in reqs],
            [r.output_ids for r in reqs],
            [self._banned(r) for r in reqs],
        )
        return [self._append(r, res) for r, res in zip(reqs, results, strict=True)]

    def _sequence_step(self, chunk: ScheduledChunk) -> SequenceStep:
        req = chunk.request
        start = req.num_computed_tokens
        ids = req.all_ids[start : start + chunk.num_tokens]
        return SequenceStep(ids, start, req.blocks, "last" if chunk.completes_prompt else "none")

    def _banned(self, req: Request) -> set[int] | None:
        if len(req.output_ids) >= req.params.min_tokens:
            return None
        return set(self.tokenizer.eog_token_ids) | set(req.params.stop_token_ids)

    def _append(self, req: Request, result) -> RequestOutput:
        tracked = self._requests[req.request_id]
        token = result.token_id
        req.output_ids.append(token)
        p = req.params
        reason = None
        is_eog = token in self.tokenizer.eog_token_ids and not p.ignore_eos
        if is_eog or token in p.stop_token_ids:
            reason, text = "stop", tracked.final_text()  # the stop token itself is not text
        else:
            text = tracked.stop.feed(tracked.detok.add(token))
            if tracked.stop.stopped:
                reason = "stop"
            elif len(req.output_ids) >= p.max_tokens or req.num_tokens >= self.max_model_len:
                reason = "length"
                text += tracked.final_text()
        logprobs = None
        if p.logprobs is not None:
            logprobs = [TokenLogprob(token, result.logprob, result.top_logprobs or [])]
        if reason is not None:
            self.scheduler.finish(req, reason)
            del self._requests[req.request_id]
        return RequestOutput(req.request_id, [token], text, reason is not None, reason, logprobs)


@dataclass
class _Tracked:
    request: Request
    detok: IncrementalDetokenizer
    stop: StopChecker

    def final_text(self) -> str:
        """What is still held back when a request ends: a half character, text that might have begun a stop."""
        text = self.stop.feed(self.detok.flush())
        return text if self.stop.stopped else text + self.stop.flush()
