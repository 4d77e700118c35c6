"""Who runs in the next step, decided with integers: a token budget, free KV blocks, a sequence limit.

There is no prefill or decode phase. Every running request catches its computed tokens up to its known
tokens: a decode needs 1, a new prompt needs all of it, and a prompt longer than what is left of the step's
budget is split across steps (chunked prefill). Decodes come first, in arrival order, and always run, whatever
the budget; running prompts' chunks, then waiting requests, take what is left of it (vLLM's
max_num_batched_tokens), and at least a quarter of it however many decodes run. So a long prompt adds at most
the budget's tokens to a step, which bounds how long a decode waits for its next token (the backend picks the
default: see EngineConfig), and a new prompt starts while the running streams go on. Waiting requests are
admitted while budget, blocks and the sequence limit allow, and for a hybrid model a free recurrent-state slot
(state_pool.py): a request that fits in blocks but finds no slot waits, whole. When blocks run out, the newest
running request not yet scheduled in the step is preempted: its blocks (and state slot) are freed and it is
recomputed later from its tokens, never left with a corrupt cache. A prompt chunk that leaves some of the prompt
for later steps ends at a multiple of the model's prefill_alignment (a hybrid's 64-position delta-rule chunks).

Under the priority policy (vLLM's `--scheduling-policy priority`) the order is (priority, arrival) instead: the
waiting requests are admitted in it, running requests are scheduled in it, and the one that comes last in it is
preempted first; a preempted request waits at its place in it.

With prefix caching (kv_cache.py) a request is admitted with the longest run of cached full blocks that
begins its tokens, and computes from there; never all of them, since its last token must run to give logits.
Blocks full of computed tokens are registered at the next step that sees them (or when the request ends or is
preempted, so a preempted request finds its own blocks again). A request asking for prompt logprobs needs every
prompt position's logits and looks nothing up.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass

from infero.engine.kv_cache import BlockPool, block_hashes
from infero.engine.request import Request, Status
from infero.engine.state_pool import StatePool

POLICIES = ("fcfs", "priority")


@dataclass(frozen=True)
class ScheduledChunk:
    request: Request
    num_tokens: int  # new tokens this step computes for the request

    @property
    def completes_prompt(self) -> bool:
        """True when after this chunk every known token is computed, so the step samples a next token."""
        return self.request.num_computed_tokens + self.num_tokens == self.request.num_tokens


class Scheduler:
    def __init__(
        self,
        pool: BlockPool,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        states: StatePool | None = None,  # a hybrid model's recurrent-state slots; None: the model has none
        prefill_alignment: int = 1,  # a prompt chunk that leaves some of the prompt ends at a multiple of this
        policy: str = "fcfs",  # or "priority": by (Request.priority, arrival)
    ):
        if policy not in POLICIES:
            raise ValueError(f"scheduling policy must be one of {', '.join(POLICIES)}; got {policy!r}")
        self.pool, self.max_num_seqs, self.max_num_batched_tokens = pool, max_num_seqs, max_num_batched_tokens
        self.states, self.prefill_alignment, self.by_priority = states, prefill_alignment, policy == "priority"
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.prefix_cache_queries = 0  # tokens of admitted requests that looked up the prefix cache
        self.prefix_cache_hits = 0  # of those, tokens found there

    def add(self, request: Request) -> None:
        if self.by_priority:
            bisect.insort(self.waiting, request, key=_priority_order)
        else:
            self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledChunk]:
        chunks: list[ScheduledChunk] = []
        scheduled: set[int] = set()
        running = sorted(self.running, key=_priority_order) if self.by_priority else self.running
        decodes = [r for r in running if r.num_tokens - r.num_computed_tokens == 1]
        # Prompt tokens this step: what the decodes leave of the budget, but never less than a quarter of it, so that
        # as many streams as the budget holds cannot keep a new prompt from starting until one of them ends (nor
        # less than one aligned chunk, which a prompt may need to move at all).
        floor = max(-(-self.max_num_batched_tokens // 4), self.prefill_alignment)
        budget = max(self.max_num_batched_tokens - len(decodes), floor)
        for req in decodes + [r for r in running if r.num_tokens - r.num_computed_tokens > 1]:
            if req not in self.running:  # preempted below to make room for an older request
                continue
            self._register_computed(req)
            left = req.num_tokens - req.num_computed_tokens
            n = left if left == 1 else self._prompt_chunk(req.num_computed_tokens, left, budget)
            if n == 0 or not self._make_room(req, n, scheduled):
                continue
            chunks.append(ScheduledChunk(req, n))
            scheduled.add(id(req))
            if left > 1:
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            n = self._admit(req, budget)
            if n is None:
                break
            self.waiting.popleft()
            req.status = Status.RUNNING
            self.running.append(req)
            chunks.append(ScheduledChunk(req, n))
            budget -= n
        return chunks

    def finish(self, req: Request, reason: str) -> None:
        """Mark a request done (or aborted) and return its blocks to the pool at once."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._register_computed(req)
        self.pool.free(req.blocks)
        req.blocks = []
        self.release_state(req)
        req.status, req.finish_reason = Status.FINISHED, reason

    def take_state(self, req: Request) -> bool:
        """Give the request a recurrent-state slot if the model has state; False when none is free."""
        if self.states is None:
            return True
        if self.states.num_free == 0:
            return False
        req.state_slot = self.states.allocate()
        return True

    def release_state(self, req: Request) -> None:
        if req.state_slot >= 0:
            self.states.free(req.state_slot)
            req.state_slot = -1

    def _admit(self, req: Request, budget: int) -> int | None:
        """Give a waiting request its cached prefix and the blocks of its first chunk; the chunk's size, or None
        when the blocks or a state slot are not there."""
        if self.states is not None and self.states.num_free == 0:
            return None
        hits = self._cached_prefix(req)
        start = len(hits) * self.pool.block_size
        n = self._prompt_chunk(start, req.num_tokens - start, budget)
        if n == 0:
            return None
        needed = self.pool.blocks_for(start + n) - len(hits)
        if needed + self.pool.num_free_among(hits) > self.pool.num_free:
            return None
        req.blocks = self.pool.share(hits) + self.pool.allocate(needed)
        self.take_state(req)
        req.num_computed_tokens, req.num_registered_blocks = start, len(hits)
        if req.num_cached_tokens is None:
            req.num_cached_tokens = start
        if self._looks_up(req):
            self.prefix_cache_queries += req.num_tokens
            self.prefix_cache_hits += start
        return n

    def _prompt_chunk(self, start: int, left: int, budget: int) -> int:
        """Tokens of a prompt chunk from position `start` with `left` tokens to go: what the budget allows, ending at
        a multiple of prefill_alignment unless it ends the prompt (0 when the budget reaches no such multiple). A
        hybrid model's delta net computes whole 64-position chunks in their chunked form and the rest token by
        token, so splits on those multiples give a prompt the same bits however the budget cuts it."""
        n = min(left, budget)
        if n < left:
            n = (start + n) // self.prefill_alignment * self.prefill_alignment - start
        return max(n, 0)

    def _make_room(self, req: Request, n: int, scheduled: set[int]) -> bool:
        """Blocks for n more tokens of a running request, preempting the newest requests not yet scheduled this
        step (the request itself last; under the priority policy the last in its order); False when it was
        preempted."""
        while not self._grow(req, n):
            candidates = [r for r in self.running if id(r) not in scheduled]
            victim = max(candidates, key=_priority_order) if self.by_priority else candidates[-1]
            self._preempt(victim)
            if victim is req:
                return False
        return True

    def _grow(self, req: Request, n: int) -> bool:
        needed = self.pool.blocks_for(req.num_computed_tokens + n) - len(req.blocks)
        if needed <= 0:
            return True
        if needed > self.pool.num_free:
            return False
        req.blocks.extend(self.pool.allocate(needed))
        return True

    def _preempt(self, req: Request) -> None:
        self.num_preemptions += 1
        self.running.remove(req)
        self._register_computed(req)  # its blocks stay cached: its recompute can find them again
        self.pool.free(req.blocks)
        self.release_state(req)  # its recompute starts at position 0, in whichever slot it gets then
        req.blocks, req.num_computed_tokens, req.status = [], 0, Status.WAITING
        req.num_registered_blocks = 0
        if self.by_priority:
            self.add(req)
        else:
            self.waiting.appendleft(req)

    def _looks_up(self, req: Request) -> bool:
        return self.pool.enable_caching and req.params.prompt_logprobs is None

    def _cached_prefix(self, req: Request) -> list[int]:
        """The cached blocks that begin the waiting request's tokens (not yet shared)."""
        if not self._looks_up(req):
            return []
        usable = (req.num_tokens - 1) // self.pool.block_size  # its last token is always computed
        return self.pool.cached_prefix(self._hashes(req)[:usable])

    def _hashes(self, req: Request) -> list[bytes]:
        """The request's block hashes, extended over its full blocks of known tokens. A placeholder token (negative:
        asynchronous scheduling has not read it yet) is not known, so hashing stops before its block."""
        size, done = self.pool.block_size, len(req.block_hashes) * self.pool.block_size
        ids = req.token_ids(done, req.num_tokens)
        if ids and min(ids) < 0:
            ids = ids[: next(i for i, t in enumerate(ids) if t < 0)]
        if len(ids) >= size:
            parent = req.block_hashes[-1] if req.block_hashes else None
            req.block_hashes += block_hashes(parent, ids, size, req.cache_salt)
        return req.block_hashes

    def _register_computed(self, req: Request) -> None:
        """Register the request's blocks that are now full of computed tokens."""
        full = req.num_computed_tokens // self.pool.block_size
        if not self.pool.enable_caching or full <= req.num_registered_blocks:
            return
        hashes = self._hashes(req)
        for i in range(req.num_registered_blocks, min(full, len(hashes))):
            self.pool.register(req.blocks[i], hashes[i])
        req.num_registered_blocks = min(full, len(hashes))


def _priority_order(req: Request) -> tuple[int, int]:
    return req.priority, req.arrival
