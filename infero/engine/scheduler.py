"""Who runs in the next step, decided with integers: a token budget, free KV blocks, a sequence limit.

There is no prefill or decode phase. Every running request catches its computed tokens up to its known
tokens: a decode needs 1, a new prompt needs all of it, and a prompt longer than what is left of the step's
budget is split across steps (chunked prefill). Running requests are served first, in arrival order, so
decodes never wait behind a long prompt; waiting requests are admitted while budget, blocks and the
sequence limit allow. When blocks run out, the newest running request is preempted: its blocks are freed
and it is recomputed later from its tokens, never left with a corrupt cache.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from infero.engine.kv_cache import BlockPool
from infero.engine.request import Request, Status


@dataclass(frozen=True)
class ScheduledChunk:
    request: Request
    num_tokens: int  # new tokens this step computes for the request

    @property
    def completes_prompt(self) -> bool:
        """True when after this chunk every known token is computed, so the step samples a next token."""
        return self.request.num_computed_tokens + self.num_tokens == self.request.num_tokens


class Scheduler:
    def __init__(self, pool: BlockPool, max_num_seqs: int = 64, max_num_batched_tokens: int = 2048):
        self.pool, self.max_num_seqs, self.max_num_batched_tokens = pool, max_num_seqs, max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledChunk]:
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        for req in list(self.running):
            if budget == 0:
                break
            if req not in self.running:  # preempted below to make room for an older request
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self._grow(req, n):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is req:
                    break
            if req.status is Status.RUNNING:
                chunks.append(ScheduledChunk(req, n))
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self._grow(req, n):
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
        self.pool.free(req.blocks)
        req.blocks = []
        req.status, req.finish_reason = Status.FINISHED, reason

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
        self.pool.free(req.blocks)
        req.blocks, req.num_computed_tokens, req.status = [], 0, Status.WAITING
        self.waiting.appendleft(req)
