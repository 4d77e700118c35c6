"""The engine: add_request / step / abort over a scheduler, a model on a backend, and a sampler.

One step = schedule, run one batched forward, sample, then turn new tokens into text and decide who is done.
A request with n > 1 computes its prompt once: when the prompt's last chunk is done, the sequence forks
into n choices that share the prompt's full KV blocks (the partly filled last block is copied).

Hybrid models (ModelConfig.is_hybrid: Gated DeltaNet layers beside full attention) keep one recurrent-state slot
per running sequence beside the KV blocks (state_pool.py), max_num_seqs of them, whose bytes come out of the KV
budget. A fork takes a slot of its own and the backend copies the parent's state into it after the shared prefill.
Prefix caching is off for them: a cached prefix's blocks hold its K/V, not the recurrent state after it.

Asynchronous scheduling (on where the backend overlaps steps: CUDA). While step k runs on the GPU, the engine
queues step k + 1 before it reads step k's tokens: each sequence that samples in step k gets a placeholder token
(PENDING), the scheduler gives it its one-token decode as usual, and the backend feeds the placeholder from step
k's sampled tokens on the device (TokenFeed). Then the host reads step k's tokens, replaces the placeholders and
does its text and stop work while the GPU runs step k + 1, so the GPU does not wait on the host between steps.
A step is queued ahead only when the next one is certain to be exactly these decodes: nothing waiting, no
sequence at its length limit, blocks for every sequence without preempting, and no sampling that needs the
tokens on the host first (grammars, repetition / frequency / presence penalties). A sequence that stops on a
token of step k (end of generation, a stop string, an abort) has its step k + 1 token dropped; its blocks are
freed at once, and whatever reuses them is queued behind step k + 1, so its stale cache write comes first.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from dataclasses import dataclass

import numpy as np

from infero.engine.batch import SequenceStep, TokenFeed, build_batch
from infero.engine.kv_cache import DEFAULT_BLOCK_SIZE, BlockPool
from infero.engine.request import Request, RequestOutput, Status, TokenLogprob
from infero.engine.sampling import NON_FINITE_LOGITS, SampledTokens, SamplingParams, raw_logprobs, top_logprobs
from infero.engine.scheduler import ScheduledChunk, Scheduler
from infero.engine.state_pool import StatePool
from infero.engine.stop import StopChecker
from infero.errors import InferoError, NonFiniteLogitsError, PromptTooLongError
from infero.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass(frozen=True)
class EngineConfig:
    max_model_len: int | None = None  # defaults to the model's context length
    max_num_seqs: int = 64
    # Tokens a step computes: decodes first (always), prompt chunks take what is left. None: the backend's
    # default (CpuBackend, CudaBackend.default_max_num_batched_tokens): the CPU's bounds a step near 0.4 s.
    max_num_batched_tokens: int | None = None
    block_size: int = DEFAULT_BLOCK_SIZE
    kv_cache_bytes: int | None = None  # the KV pool's byte budget; None: 1 GiB on the CPU, the GPU's free share
    gpu_memory_utilization: float = 0.90  # CUDA backend: the share of GPU memory weights, workspace and KV may use
    seed: int | None = None  # for requests without their own seed
    async_scheduling: bool | None = None  # queue step k + 1 before reading step k's tokens; None: where it pays
    cpu_threads: int | None = None  # CPU backend: BLAS threads; None: $INFERO_CPU_THREADS, else 1
    enable_prefix_caching: bool = True  # reuse the KV blocks of earlier requests' identical prompt prefixes
    scheduling_policy: str = "fcfs"  # or "priority": requests' priority, then arrival (vLLM's --scheduling-policy)


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_usage: float  # fraction of KV blocks in use
    num_preemptions: int
    kv_capacity_tokens: int
    prompt_tokens_total: int
    generation_tokens_total: int
    prefix_cache_queries: int  # tokens of prompts that looked up the prefix cache
    prefix_cache_hits: int  # of those, tokens found cached
    kv_blocks_referenced: int  # blocks some sequence holds (0 when nothing runs: a leak otherwise)
    kv_blocks_cached: int  # blocks holding a cached prefix, held or free
    prefix_caching: bool  # on as configured, but never for a hybrid model
    num_state_slots: int  # recurrent-state slots (hybrid models; 0 otherwise)
    state_slots_used: int  # slots some sequence holds (0 when nothing runs: a leak otherwise)


class Engine:
    def __init__(self, model, backend, tokenizer: Tokenizer, config: EngineConfig | None = None):
        config = config or EngineConfig()
        if config.max_num_batched_tokens is None:
            config = dataclasses.replace(config, max_num_batched_tokens=backend.default_max_num_batched_tokens)
        self.model, self.backend, self.tokenizer, self.config = model, backend, tokenizer, config
        mc = model.config
        backend.prepare(mc, config)
        self.sampler = backend.sampler(config.seed)  # before the KV cache takes what memory is left
        limit = min(config.max_model_len or mc.context_length, mc.context_length)
        # Never more blocks than max_num_seqs sequences of the full context could hold: the rest would idle.
        useful = config.max_num_seqs * -(-limit // config.block_size)
        num_state_slots = config.max_num_seqs if mc.is_hybrid else 0
        self.state_bytes = num_state_slots * backend.state_bytes_per_slot(mc) if num_state_slots else 0
        budget = backend.kv_cache_bytes(config)
        num_blocks = min(useful, (budget - self.state_bytes) // backend.kv_block_bytes(mc, config.block_size))
        if num_blocks < 1 and num_state_slots:
            raise InferoError(
                f"no memory is left for the KV cache: the recurrent state of --max-num-seqs {num_state_slots} "
                f"sequences takes {self.state_bytes / 2**20:,.0f} MiB of the {budget / 2**20:,.0f} MiB budget; "
                "lower --max-num-seqs or raise the memory budget (--kv-cache-memory)"
            )
        if num_blocks < 1:
            raise InferoError("no memory is left for the KV cache: lower the model size or raise the memory budget")
        self.prefix_caching = config.enable_prefix_caching and not mc.is_hybrid
        self.pool = BlockPool(num_blocks, config.block_size, self.prefix_caching)
        self.states = StatePool(num_state_slots) if num_state_slots else None
        self.cache = backend.allocate_kv_cache(mc, num_blocks, config.block_size, num_state_slots)
        self.max_model_len = min(limit, num_blocks * config.block_size)
        self.scheduler = Scheduler(self.pool, config.max_num_seqs, config.max_num_batched_tokens, self.states,
                                   model.prefill_alignment, config.scheduling_policy)  # fmt: skip
        self._seqs: dict[tuple[str, int], _Sequence] = {}
        self._choices: dict[str, int] = {}  # request id -> choices still running
        self._arrivals = itertools.count()
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self._grammars = None  # built on the first constrained request (~0.1 s for a 50k vocabulary)
        overlaps = getattr(backend, "overlaps_steps", False)
        self.async_scheduling = overlaps if config.async_scheduling is None else config.async_scheduling
        self._queued: _Launched | None = None  # a step launched before the previous one's tokens were read

    @property
    def grammars(self):
        if self._grammars is None:
            from infero.engine.structured import GrammarCompiler

            self._grammars = GrammarCompiler(self.tokenizer)
        return self._grammars

    @property
    def kv_capacity_tokens(self) -> int:
        return self.pool.num_blocks * self.pool.block_size

    def validate(self, prompt_ids: list[int], params: SamplingParams, priority: int = 0) -> None:
        """Raise the user's error for a request that cannot run; reads only constants (thread-safe)."""
        self.check_priority(priority)
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
        if params.n > self.config.max_num_seqs:
            raise InferoError(f"n={params.n} exceeds the engine's --max-num-seqs ({self.config.max_num_seqs})")
        if params.structured is not None:
            self.grammars.compile_grammar(params.structured)  # an invalid schema or regex fails here, not in a step

    def check_priority(self, priority: int) -> None:
        """A priority other than 0 asks for the priority policy; under fcfs it would be ignored, so it is refused."""
        if priority != 0 and self.config.scheduling_policy != "priority":
            raise InferoError(f"priority {priority} needs priority scheduling, which is off: run with "
                              "--scheduling-policy priority (requests are scheduled by arrival alone)")  # fmt: skip

    def add_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        priority: int = 0,
    ) -> None:
        """Queue a request; only requests with the same `cache_salt` share prefix cache blocks; `priority` orders
        requests under the priority policy (lower first)."""
        if request_id in self._choices:
            raise InferoError(f"request id {request_id!r} is already running")
        self.validate(prompt_ids, params, priority)
        req = Request(request_id, list(prompt_ids), params, next(self._arrivals), cache_salt=cache_salt,
                      priority=priority)  # fmt: skip
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = [None]
        self._track(req)
        self._choices[request_id] = 1
        self.scheduler.add(req)
        self.prompt_tokens_total += len(prompt_ids)

    def abort(self, request_id: str) -> None:
        for key in [k for k in self._seqs if k[0] == request_id]:
            seq = self._seqs.pop(key)
            if not seq.request.finished:
                self.scheduler.finish(seq.request, "abort")
        self._choices.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._queued is not None

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_usage=1.0 - self.pool.num_free / self.pool.num_blocks,
            num_preemptions=self.scheduler.num_preemptions,
            kv_capacity_tokens=self.kv_capacity_tokens,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            prefix_cache_queries=self.scheduler.prefix_cache_queries,
            prefix_cache_hits=self.scheduler.prefix_cache_hits,
            kv_blocks_referenced=self.pool.num_referenced,
            kv_blocks_cached=self.pool.num_cached,
            prefix_caching=self.prefix_caching,
            num_state_slots=self.states.num_slots if self.states else 0,
            state_slots_used=self.states.num_used if self.states else 0,
        )

    def step(self) -> list[RequestOutput]:
        launched = self._queued or self._launch(self.scheduler.schedule())
        self._queued = None
        if launched is None:
            return []
        if self.async_scheduling and self._can_queue_after(launched):
            self._queued = self._queue_after(launched)
        return self._finish(launched)

    def _launch(self, chunks: list[ScheduledChunk], feed: TokenFeed | None = None) -> _Launched | None:
        """Run the chunks' forward and queue the sampling of the sequences whose prompts they complete."""
        if not chunks:
            return None
        steps = [self._sequence_step(c) for c in chunks]
        now = time.monotonic()
        for c in chunks:
            if c.request.first_scheduled is None:
                c.request.first_scheduled = now
        logits = self.backend.forward(self.model, build_batch(steps, self.pool.block_size), self.cache, feed)
        rows, sampling, offset = [], [], 0
        for chunk, step in zip(chunks, steps, strict=True):
            n_rows = {"all": chunk.num_tokens, "last": 1, "none": 0}[step.logits]
            req, completes = chunk.request, chunk.completes_prompt
            if step.logits == "all":
                host_rows = self.backend.to_host(logits, offset, offset + n_rows)
                self._record_prompt_logprobs(req, req.num_computed_tokens, host_rows)
            offset += n_rows
            req.num_computed_tokens += chunk.num_tokens
            if completes:
                for seq_req in self._fork(req):
                    sampling.append(seq_req)
                    rows.append(offset - 1)
        if not sampling:
            return _Launched([], None)
        args = (
            logits,
            rows,
            [r.params for r in sampling],
            [r.prompt_ids for r in sampling],
            [r.output_ids for r in sampling],
            [self._banned(r) for r in sampling],
            self._allowed_masks(sampling),
        )
        launch = getattr(self.sampler, "launch", None)  # a sampler with sample() only: done on the host
        sampled = launch(*args) if launch is not None else SampledTokens(self.sampler.sample(*args))
        return _Launched(sampling, sampled)

    def _can_queue_after(self, launched: _Launched) -> bool:
        """Whether the step after `launched` is certain to be one decode for each of its sequences, with nothing
        that needs their new tokens on the host first."""
        live = [r for r in launched.sampling if not r.finished]
        if not live or self.scheduler.waiting or len(live) != len(self.scheduler.running):
            return False
        pool = self.pool
        if sum(pool.blocks_for(r.num_computed_tokens + 1) > len(r.blocks) for r in live) > pool.num_free:
            return False
        for r in live:
            p = r.params
            if self._seqs[r.key].matcher is not None or p.repetition_penalty != 1.0:
                return False
            if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
                return False
            if len(r.output_ids) + 1 >= p.max_tokens or r.num_tokens + 1 >= self.max_model_len:
                return False  # the coming token may be its last: a step queued after it would be wasted
        return True

    def _queue_after(self, launched: _Launched) -> _Launched | None:
        """Launch the next step now, its input tokens fed from `launched`'s sampling on the device."""
        row_of = {}
        for row, r in enumerate(launched.sampling):
            if not r.finished:
                r.output_ids.append(PENDING)
                row_of[id(r)] = row
        chunks = self.scheduler.schedule()
        feed = np.array([row_of[id(c.request)] for c in chunks], np.int32)
        return self._launch(chunks, TokenFeed(launched.sampled, feed))

    def _finish(self, launched: _Launched) -> list[RequestOutput]:
        """Read the launched step's tokens and turn them into outputs (skipping sequences that ended meanwhile)."""
        if all(r.finished for r in launched.sampling):
            return []
        results = launched.sampled.results()
        return [self._append(r, res) for r, res in zip(launched.sampling, results, strict=True) if not r.finished]

    def _track(self, req: Request) -> None:
        p = req.params
        detok = IncrementalDetokenizer(
            self.tokenizer, skip_special_tokens=p.skip_special_tokens, prompt_ids=req.prompt_ids
        )
        matcher = self.grammars.compile(p.structured) if p.structured is not None else None
        self._seqs[req.key] = _Sequence(req, detok, StopChecker(p.stop, p.include_stop_str_in_output), matcher)

    def _sequence_step(self, chunk: ScheduledChunk) -> SequenceStep:
        req = chunk.request
        start = req.num_computed_tokens
        ids = req.token_ids(start, start + chunk.num_tokens)
        wants_prompt_logprobs = req.prompt_logprobs is not None and len(req.prompt_logprobs) < len(req.prompt_ids)
        logits = "all" if wants_prompt_logprobs else "last" if chunk.completes_prompt else "none"
        return SequenceStep(ids, start, req.blocks, logits, req.state_slot)

    def _record_prompt_logprobs(self, req: Request, start: int, chunk_logits: np.ndarray) -> None:
        """Row i of a prompt chunk predicts the token at start + i + 1: that token's logprob and the top-N."""
        for i, row in enumerate(chunk_logits):
            target = start + i + 1
            if target != len(req.prompt_logprobs) or target >= len(req.prompt_ids):
                continue  # already known (a recompute after preemption) or past the prompt
            lp = raw_logprobs(row)
            token = req.prompt_ids[target]
            rank = int(np.count_nonzero(lp >= lp[token]))
            req.prompt_logprobs.append(
                TokenLogprob(token, float(lp[token]), top_logprobs(lp, req.params.prompt_logprobs), rank)
            )

    def _fork(self, req: Request) -> list[Request]:
        """The sequences that sample from this request's logits row: itself, plus its n - 1 siblings the
        first time its prompt completes."""
        n = req.params.n
        if n == 1 or req.index != 0 or req.output_ids or self._choices.get(req.request_id, 0) > 1:
            return [req]
        seqs = [req]
        full = req.num_computed_tokens // self.pool.block_size
        partial = len(req.blocks) > full
        for j in range(1, n):
            params = (
                req.params if req.params.seed is None else dataclasses.replace(req.params, seed=req.params.seed + j)
            )
            child = Request(req.request_id, req.prompt_ids, params, next(self._arrivals), index=j,
                            priority=req.priority, cache_salt=req.cache_salt,
                            block_hashes=list(req.block_hashes))  # fmt: skip
            child.prompt_logprobs, child.num_cached_tokens = req.prompt_logprobs, req.num_cached_tokens
            child.first_scheduled = req.first_scheduled
            room = len(self.scheduler.running) < self.config.max_num_seqs
            if room and (not partial or self.pool.num_free > 0) and self.scheduler.take_state(child):
                child.blocks = self.pool.share(req.blocks[:full])
                if partial:
                    child.blocks += self.pool.allocate(1)
                    self.backend.copy_blocks(self.cache, [(req.blocks[full], child.blocks[-1])])
                if child.state_slot >= 0:  # the forward that completed the prompt has run: its state is final
                    self.backend.copy_state(self.cache, req.state_slot, child.state_slot)
                child.num_computed_tokens = req.num_computed_tokens
                child.num_registered_blocks = req.num_registered_blocks
                child.status = Status.RUNNING
                self.scheduler.running.append(child)
                seqs.append(child)
            else:  # no room among the running sequences (max_num_seqs: the step buffers and graphs are sized for it),
                # no block to copy the prompt's tail into, or no state slot: the sibling recomputes its prompt later
                self.scheduler.add(child)
            self._track(child)
        self._choices[req.request_id] = n
        return seqs

    def _banned(self, req: Request) -> set[int] | None:
        if len(req.output_ids) >= req.params.min_tokens:
            return None
        matcher = self._seqs[req.key].matcher
        if matcher is not None and matcher.is_accepting():
            return None  # the grammar may be complete: end-of-generation can be its only allowed token
        return set(self.tokenizer.eog_token_ids) | set(req.params.stop_token_ids)

    def _allowed_masks(self, sampling: list[Request]) -> list[np.ndarray | None] | None:
        matchers = [self._seqs[r.key].matcher for r in sampling]
        if not any(m is not None for m in matchers):
            return None
        return self.grammars.bitmasks(matchers, self.model.config.vocab_size)

    def _append(self, req: Request, result) -> RequestOutput:
        if result.token_id == NON_FINITE_LOGITS:
            return self._fail(req, NonFiniteLogitsError(NON_FINITE_MESSAGE))
        seq = self._seqs[req.key]
        first = not req.output_ids or req.output_ids == [PENDING]
        token = result.token_id
        if req.output_ids and req.output_ids[-1] == PENDING:
            req.output_ids[-1] = token  # the step queued after this one has already taken its place
        else:
            req.output_ids.append(token)
        self.generation_tokens_total += 1
        p = req.params
        reason = stop_reason = None
        is_eog = token in self.tokenizer.eog_token_ids and not p.ignore_eos
        if is_eog or token in p.stop_token_ids:
            reason, text = "stop", seq.final_text()  # the stop token itself is not text
            stop_reason = None if is_eog else token
        else:
            text = seq.stop.feed(seq.detok.add(token))
            if seq.matcher is not None:
                seq.matcher.accept(token)
            if seq.stop.stopped:
                reason, stop_reason = "stop", seq.stop.matched
            elif seq.matcher is not None and seq.matcher.is_finished():
                reason = "stop"  # the grammar is complete: no step is spent sampling the end token
                text += seq.final_text()
            elif len(req.output_ids) >= p.max_tokens or req.num_tokens >= self.max_model_len:
                reason = "length"
                text += seq.final_text()
        logprobs = None
        if p.logprobs is not None:
            logprobs = [TokenLogprob(token, result.logprob, result.top_logprobs or [])]
        if reason is not None:
            self.scheduler.finish(req, reason)
            del self._seqs[req.key]
            self._choices[req.request_id] -= 1
            if self._choices[req.request_id] == 0:
                del self._choices[req.request_id]
        return RequestOutput(
            req.request_id,
            [token],
            text,
            reason is not None,
            reason,
            logprobs,
            index=req.index,
            prompt_logprobs=req.prompt_logprobs if first else None,
            num_prompt_tokens=len(req.prompt_ids),
            num_cached_tokens=req.num_cached_tokens or 0,
            stop_reason=stop_reason,
            first_scheduled=req.first_scheduled,
        )

    def _fail(self, req: Request, error: InferoError) -> RequestOutput:
        """Finish one sequence whose step went wrong for it alone; its output carries the error to the caller while
        the other sequences go on."""
        self.scheduler.finish(req, "error")
        del self._seqs[req.key]
        self._choices[req.request_id] -= 1
        if self._choices[req.request_id] == 0:
            del self._choices[req.request_id]
        return RequestOutput(req.request_id, [], "", True, "error", index=req.index,
                             num_prompt_tokens=len(req.prompt_ids), error=error)  # fmt: skip


NON_FINITE_MESSAGE = (
    "the model produced non-finite logits (NaN or infinity) for this request: its weights are broken; "
    "check the model file or try another quantization of it"
)
PENDING = -1  # the output token of a step whose tokens the host has not read yet (asynchronous scheduling)


@dataclass
class _Launched:
    """A step whose forward and sampling are queued: the sequences sampled, in sampler row order, and their
    tokens, which may still be on the device."""

    sampling: list[Request]
    sampled: SampledTokens | None


@dataclass
class _Sequence:
    request: Request
    detok: IncrementalDetokenizer
    stop: StopChecker
    matcher: object | None = None  # infero.engine.structured.Matcher for a constrained sequence

    def final_text(self) -> str:
        """What is still held back when a sequence ends: a half character, text that might have begun a stop."""
        text = self.stop.feed(self.detok.flush())
        return text if self.stop.stopped else text + self.stop.flush()
