"""A request's state as it moves through the engine: its tokens, its cache blocks, its output so far."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from infero.engine.sampling import SamplingParams
from infero.errors import InferoError


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the top-N alternatives, most likely first
    rank: int | None = None  # a prompt token's: how many tokens are at least as likely (1: the most likely)


@dataclass(eq=False)  # identity: the scheduler's list membership tests must not compare token lists
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: int  # admission order; the newest running request is preempted first
    index: int = 0  # which of the request's n choices this sequence is
    priority: int = 0  # under the priority policy, lower runs first and is preempted last (vLLM's)
    first_scheduled: float | None = None  # time.monotonic() of the first step that computed any of it
    output_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    blocks: list[int] = field(default_factory=list)
    state_slot: int = -1  # its recurrent-state slot while it runs (hybrid models); -1: none
    status: Status = Status.WAITING
    finish_reason: str | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # filled while the prompt is computed
    cache_salt: str | None = None  # enters the first block's hash: only requests with the same salt share blocks
    block_hashes: list[bytes] = field(default_factory=list)  # of its full blocks of known tokens, first to last
    num_registered_blocks: int = 0  # blocks[:this] are registered in the pool's prefix cache
    num_cached_tokens: int | None = None  # prompt tokens found in the prefix cache at its first admission

    @property
    def key(self) -> tuple[str, int]:
        return self.request_id, self.index

    def token_ids(self, start: int, stop: int) -> list[int]:
        """Tokens [start, stop) of prompt + output, without joining the two lists (a decode step takes one)."""
        p = len(self.prompt_ids)
        if stop <= p:
            return self.prompt_ids[start:stop]
        if start >= p:
            return self.output_ids[start - p : stop - p]
        return self.prompt_ids[start:] + self.output_ids[: stop - p]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED


@dataclass
class RequestOutput:
    """What one step added to one request: new token ids, the new text, and whether it is done."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None
    index: int = 0
    prompt_logprobs: list[TokenLogprob | None] | None = None  # on a choice's first output, when asked for
    num_prompt_tokens: int = 0
    error: InferoError | None = None  # finish_reason "error": why this choice failed (the others go on)
    num_cached_tokens: int = 0  # of the prompt tokens, those whose KV came from the prefix cache
    stop_reason: str | int | None = None  # finish_reason "stop": the stop string or stop token id (None: end of text)
    first_scheduled: float | None = None  # time.monotonic() when the request first ran: its queue time ends there
