"""The token-budget scheduler: decodes first, chunked prefill, admission by free blocks, preemption."""

import pytest

from infero.engine.kv_cache import BlockPool
from infero.engine.request import Request, Status
from infero.engine.sampling import SamplingParams
from infero.engine.scheduler import Scheduler


def request(i, prompt_len):
    return Request(f"r{i}", list(range(1, prompt_len + 1)), SamplingParams(), arrival=i)


def advance(chunks, sampled=True):
    """Play the engine's part: mark chunks computed and append a token where the step samples."""
    for c in chunks:
        done = c.completes_prompt
        c.request.num_computed_tokens += c.num_tokens
        if done and sampled:
            c.request.output_ids.append(7)


def test_long_prompt_is_split_and_decodes_go_first():
    s = Scheduler(BlockPool(64, 16), max_num_seqs=8, max_num_batched_tokens=32)
    short = request(0, 5)
    s.add(short)
    advance(s.schedule())
    long = request(1, 100)
    s.add(long)
    for _ in range(4):
        chunks = s.schedule()
        assert chunks[0].request is short and chunks[0].num_tokens == 1  # the decode is never starved
        assert sum(c.num_tokens for c in chunks) <= 32
        advance(chunks)
    assert long.num_computed_tokens == 31 * 3 + 7  # 93 after three full chunks of 31, then the last 7
    assert long.output_ids == [7]


def test_admission_waits_for_free_blocks_and_sequence_limit():
    s = Scheduler(BlockPool(4, 16), max_num_seqs=2, max_num_batched_tokens=1000)
    a, b, c = request(0, 40), request(1, 20), request(2, 5)
    for r in (a, b, c):
        s.add(r)
    chunks = s.schedule()
    assert [ch.request for ch in chunks] == [a]  # a takes 3 blocks; b needs 2 of the 1 left
    assert b.status is Status.WAITING and c.status is Status.WAITING
    s.finish(a, "stop")
    assert s.pool.num_free == 4
    assert [ch.request for ch in s.schedule()] == [b, c]


def test_preemption_frees_newest_and_recomputes_it():
    s = Scheduler(BlockPool(3, 4, enable_caching=False), max_num_seqs=4, max_num_batched_tokens=100)
    old, new = request(0, 4), request(1, 4)
    s.add(old)
    s.add(new)
    advance(s.schedule())  # 1 block each; both now hold 5 tokens and need a second block to decode
    advance(s.schedule())  # old grows into the last free block; new must be preempted
    assert old.status is Status.RUNNING and len(old.blocks) == 2
    assert new.status is Status.WAITING and new.blocks == [] and new.num_computed_tokens == 0
    assert len(new.output_ids) == 1  # its generated token is kept and recomputed with the prompt
    s.finish(old, "stop")
    chunks = s.schedule()
    assert [(c.request, c.num_tokens) for c in chunks] == [(new, 5)]


def test_finish_and_abort_return_blocks_at_once():
    s = Scheduler(BlockPool(8, 16), max_num_batched_tokens=64)
    r = request(0, 40)
    s.add(r)
    advance(s.schedule())
    assert s.pool.num_free == 5
    s.finish(r, "abort")
    assert s.pool.num_free == 8 and not s.has_unfinished()


def test_requests_are_told_apart_by_identity_not_by_their_tokens():
    """Two waiting sequences with equal fields are different requests: finishing one must not take the other out
    of the queue (and membership tests must not compare token lists, which made scheduling quadratic)."""
    pool = BlockPool(8, 4)
    sched = Scheduler(pool, max_num_seqs=4, max_num_batched_tokens=64)
    a, b = (Request("same", [1, 2, 3], SamplingParams(), arrival=0) for _ in range(2))
    sched.add(a)
    sched.add(b)
    sched.finish(b, "abort")
    assert len(sched.waiting) == 1 and sched.waiting[0] is a


def test_token_ids_slice_prompt_and_output_without_joining_them():
    req = Request("r", [1, 2, 3, 4], SamplingParams(), arrival=0)
    req.output_ids = [5, 6, 7]
    joined = req.prompt_ids + req.output_ids
    for start in range(8):
        for stop in range(start, 8):
            assert req.token_ids(start, stop) == joined[start:stop]


def test_every_decode_runs_even_past_the_budget_and_prompts_keep_a_quarter_of_it():
    s = Scheduler(BlockPool(64, 16), max_num_seqs=16, max_num_batched_tokens=18)
    decoding = [request(i, 3) for i in range(6)]
    for r in decoding:
        s.add(r)
    advance(s.schedule())  # six 3-token prompts in one step of 18 tokens
    s.max_num_batched_tokens = 4
    waiting = request(9, 40)
    s.add(waiting)
    chunks = s.schedule()
    # 6 decodes over a budget of 4: the waiting prompt still starts, with a quarter of the budget
    assert [(c.request, c.num_tokens) for c in chunks] == [(r, 1) for r in decoding] + [(waiting, 1)]
    advance(chunks)
    for r in decoding[:4]:
        s.finish(r, "stop")
    chunks = s.schedule()
    assert [(c.request, c.num_tokens) for c in chunks] == [(r, 1) for r in decoding[4:]] + [(waiting, 2)]


def test_a_decode_behind_a_prefilling_request_still_runs_first():
    s = Scheduler(BlockPool(64, 16), max_num_seqs=8, max_num_batched_tokens=8)
    long, short = request(0, 100), request(1, 3)
    s.add(long)
    advance(s.schedule())
    s.running.append(short)  # as a request re-admitted after preemption lands behind one still prefilling
    short.status, short.blocks = Status.RUNNING, s.pool.allocate(1)
    short.num_computed_tokens = 3
    short.output_ids.append(7)
    chunks = s.schedule()
    assert [(c.request, c.num_tokens) for c in chunks] == [(short, 1), (long, 7)]


def test_aligned_prompt_chunks_end_on_multiples_of_the_alignment_or_at_the_prompt_end():
    s = Scheduler(BlockPool(64, 16), max_num_seqs=8, max_num_batched_tokens=150, prefill_alignment=64)
    decoding, long = request(0, 3), request(1, 300)
    s.add(decoding)
    advance(s.schedule())
    s.add(long)
    ends = []
    while long.num_computed_tokens < 300:
        chunks = s.schedule()
        assert chunks[0].request is decoding  # the decode still runs first, every step
        advance(chunks)
        ends.append(long.num_computed_tokens)
    assert ends == [128, 256, 300]  # 149 tokens of budget each step, cut back to the last multiple of 64


def test_an_aligned_prompt_moves_by_one_chunk_when_decodes_take_the_budget():
    s = Scheduler(BlockPool(64, 16), max_num_seqs=64, max_num_batched_tokens=80, prefill_alignment=64)
    streams = [request(i, 2) for i in range(40)]
    for r in streams:
        s.add(r)
    advance(s.schedule())
    long = request(99, 200)
    s.add(long)
    advance(s.schedule())  # 40 decodes leave 40 of 80 tokens: the floor is one whole chunk, not a quarter (20)
    assert long.num_computed_tokens == 64


def test_a_waiting_prompt_is_not_admitted_with_less_than_a_chunk_left():
    s = Scheduler(BlockPool(64, 16, enable_caching=False), max_num_seqs=8, max_num_batched_tokens=100,
                  prefill_alignment=64)  # fmt: skip
    first, second = request(0, 90), request(1, 200)
    s.add(first)
    s.add(second)
    chunks = s.schedule()  # first takes 90 (its whole prompt); 10 left reach no multiple of 64 for second
    assert [(c.request, c.num_tokens) for c in chunks] == [(first, 90)] and second.status is Status.WAITING
    advance(chunks)
    chunks = s.schedule()
    assert [(c.request, c.num_tokens) for c in chunks] == [(first, 1), (second, 64)]


def prioritized(i, prompt_len, priority):
    return Request(f"r{i}", list(range(1, prompt_len + 1)), SamplingParams(), arrival=i, priority=priority)


def test_priority_policy_admits_by_priority_then_arrival():
    s = Scheduler(BlockPool(64, 16), max_num_seqs=2, max_num_batched_tokens=1000, policy="priority")
    low, high, mid, high_later = (
        prioritized(0, 5, 5),
        prioritized(1, 5, -1),
        prioritized(2, 5, 0),
        prioritized(3, 5, -1),
    )
    for r in (low, high, mid, high_later):
        s.add(r)
    assert [c.request for c in s.schedule()] == [high, high_later]
    fcfs = Scheduler(BlockPool(64, 16), max_num_seqs=2, max_num_batched_tokens=1000)
    for r in (prioritized(0, 5, 5), prioritized(1, 5, -1)):
        fcfs.add(r)
    assert [c.request.priority for c in fcfs.schedule()] == [5, -1]  # fcfs: arrival alone


def test_priority_policy_preempts_the_least_urgent_and_requeues_it_in_order():
    s = Scheduler(BlockPool(3, 4, enable_caching=False), max_num_seqs=4, max_num_batched_tokens=100, policy="priority")
    urgent_late, lax_early = prioritized(1, 4, 0), prioritized(0, 4, 9)
    s.add(lax_early)
    s.add(urgent_late)
    advance(s.schedule())  # 1 block each; both need a second to decode, and one block is left
    advance(s.schedule())  # fcfs would preempt the newest (urgent_late); priority preempts lax_early
    assert urgent_late.status is Status.RUNNING and len(urgent_late.blocks) == 2
    assert lax_early.status is Status.WAITING and lax_early.num_computed_tokens == 0
    waiting_first = prioritized(2, 4, 1)
    s.add(waiting_first)
    assert list(s.waiting) == [waiting_first, lax_early]  # the preempted request waits at its place in the order
    s.finish(urgent_late, "stop")
    assert [c.request for c in s.schedule()] == [waiting_first, lax_early]


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="fcfs, priority"):
        Scheduler(BlockPool(4, 4), policy="lifo")
