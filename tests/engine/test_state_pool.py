"""Recurrent-state slots: the pool, and the scheduler's admission by blocks and slots together."""

import pytest

from infero.engine.kv_cache import BlockPool
from infero.engine.request import Request, Status
from infero.engine.sampling import SamplingParams
from infero.engine.scheduler import Scheduler
from infero.engine.state_pool import StatePool


def request(i, prompt_len):
    return Request(f"r{i}", list(range(1, prompt_len + 1)), SamplingParams(), arrival=i)


def advance(chunks):
    for c in chunks:
        done = c.completes_prompt
        c.request.num_computed_tokens += c.num_tokens
        if done:
            c.request.output_ids.append(7)


def test_pool_hands_out_the_lowest_free_slot_and_refuses_a_double_free():
    pool = StatePool(3)
    assert [pool.allocate() for _ in range(3)] == [0, 1, 2] and pool.num_free == 0
    with pytest.raises(RuntimeError, match="all 3"):
        pool.allocate()
    pool.free(2)
    pool.free(0)
    assert pool.num_used == 1 and pool.allocate() == 0
    with pytest.raises(RuntimeError, match="slot 2 is not held"):
        pool.free(2)
        pool.free(2)


def test_a_request_that_fits_in_blocks_waits_whole_for_a_slot():
    s = Scheduler(BlockPool(16, 16), max_num_seqs=8, max_num_batched_tokens=1000, states=StatePool(2))
    a, b, c = request(0, 5), request(1, 5), request(2, 5)
    for r in (a, b, c):
        s.add(r)
    chunks = s.schedule()
    assert [ch.request for ch in chunks] == [a, b] and (a.state_slot, b.state_slot) == (0, 1)
    assert c.status is Status.WAITING and c.blocks == [] and c.state_slot == -1  # no blocks taken without a slot
    advance(chunks)
    assert [ch.request for ch in s.schedule()] == [a, b]  # the running decodes go on
    s.finish(a, "stop")
    assert [ch.request for ch in s.schedule()] == [b, c] and c.state_slot == 0


def test_slots_free_on_finish_abort_and_preemption():
    states = StatePool(4)
    s = Scheduler(BlockPool(3, 4, enable_caching=False), max_num_seqs=4, max_num_batched_tokens=100, states=states)
    old, new = request(0, 4), request(1, 4)
    s.add(old)
    s.add(new)
    advance(s.schedule())
    assert states.num_used == 2
    advance(s.schedule())  # old grows into the last block; new is preempted and lets its slot go
    assert new.status is Status.WAITING and new.state_slot == -1 and states.num_used == 1
    s.finish(old, "abort")
    assert states.num_used == 0 and old.state_slot == -1
    [chunk] = s.schedule()
    assert chunk.request is new and new.num_computed_tokens == 0 and new.state_slot == 0  # recomputed from 0
    s.finish(new, "stop")
    assert states.num_free == 4 and s.pool.num_free == 3


def test_a_model_without_state_gives_no_slots():
    s = Scheduler(BlockPool(8, 16), max_num_batched_tokens=64)
    r = request(0, 5)
    s.add(r)
    s.schedule()
    assert r.state_slot == -1
