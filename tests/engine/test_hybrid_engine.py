"""The engine's recurrent-state slots (hybrid models) on the stand-in of fake_hybrid.py: admission, forks,
aborts, preemption, chunked prefill, sizing and prefix caching. Its model asserts on every step that each sequence
has a slot of its own."""

import random

import pytest
from fake_hybrid import KV_BLOCK_BYTES, STATE, hybrid_engine

from infero.checkpoint import load_checkpoint
from infero.engine.sampling import SamplingParams
from infero.errors import InferoError
from infero.tokenizer import Tokenizer

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    return Tokenizer.from_gguf_metadata(load_checkpoint(tiny_model_path).metadata)


def prompt(seed: int, n: int = 20) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 250) for _ in range(n)]


def run(engine, prompts, params=GREEDY, on_step=None) -> dict[tuple[str, int], list[int]]:
    """Every choice's tokens, by (request id, choice index); on_step(engine, step number) runs before each step."""
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    tokens: dict[tuple[str, int], list[int]] = {}
    step = 0
    while engine.has_unfinished():
        if on_step is not None:
            on_step(engine, step)
        for out in engine.step():
            tokens.setdefault((out.request_id, out.index), []).extend(out.new_token_ids)
        step += 1
    return tokens


def all_free(engine) -> bool:
    stats = engine.stats()
    return (stats.state_slots_used == 0 and engine.states.num_free == engine.states.num_slots
            and stats.kv_blocks_referenced == 0)  # fmt: skip


def alone(tokenizer, p, params=GREEDY) -> list[int]:
    return run(hybrid_engine(tokenizer), [p], params)[("r0", 0)]


def test_a_request_waits_for_a_slot_and_then_gives_its_tokens_alone(tokenizer):
    prompts = [prompt(i) for i in range(3)]
    engine = hybrid_engine(tokenizer, max_num_seqs=2, max_num_batched_tokens=64)
    waited = []

    def watch(engine, step):
        stats = engine.stats()
        assert stats.state_slots_used == stats.num_running <= 2
        waited.append(stats.num_waiting)

    got = run(engine, prompts, on_step=watch)
    assert waited[:3] == [3, 1, 1]  # the third request waited while the first two held both slots
    assert [got[(f"r{i}", 0)] for i in range(3)] == [alone(tokenizer, p) for p in prompts]
    assert all_free(engine)


def test_forks_copy_the_parents_state_after_the_shared_prefill(tokenizer):
    p = prompt(1)
    engine = hybrid_engine(tokenizer)
    got = run(engine, [p], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, n=3))
    assert [got[("r0", j)] for j in range(3)] == [alone(tokenizer, p)] * 3
    assert engine.backend.state_copies == [(0, 1), (0, 2)]
    assert all_free(engine)


def test_a_fork_without_a_free_slot_recomputes_its_prompt_later(tokenizer):
    p, other = prompt(2), prompt(3)
    engine = hybrid_engine(tokenizer, max_num_seqs=2)
    got = run(engine, [other, p], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, n=2))
    assert got[("r1", 0)] == got[("r1", 1)] == alone(tokenizer, p)
    assert engine.backend.state_copies == []  # both slots were held when r1's prompt completed
    assert all_free(engine)


def test_a_request_after_an_aborted_one_gives_its_fresh_engine_tokens(tokenizer):
    engine = hybrid_engine(tokenizer, max_num_seqs=1)

    def abort_midway(engine, step):
        if step == 5:
            engine.abort("r0")

    aborted = run(engine, [prompt(4)], on_step=abort_midway)[("r0", 0)]
    assert 0 < len(aborted) < GREEDY.max_tokens and all_free(engine)
    after = run(engine, [prompt(5)])  # runs in the slot the aborted request left mid-sequence
    assert after[("r0", 0)] == alone(tokenizer, prompt(5))


@pytest.mark.parametrize("budget", [1, 7, 64])
def test_chunked_prefill_gives_the_tokens_of_a_whole_prefill(tokenizer, budget):
    prompts = [prompt(10 + i, 40 + 9 * i) for i in range(3)]
    whole = run(hybrid_engine(tokenizer, max_num_batched_tokens=512), prompts)
    assert run(hybrid_engine(tokenizer, max_num_batched_tokens=budget), prompts) == whole


def test_preemption_frees_the_slot_and_the_recompute_gives_the_same_tokens(tokenizer):
    prompts = [prompt(20 + i, 30) for i in range(4)]
    want = run(hybrid_engine(tokenizer), prompts)
    # Four sequences of ~42 tokens need 12 blocks of 16; 6 force preemptions.
    engine = hybrid_engine(tokenizer, kv_cache_bytes=6 * KV_BLOCK_BYTES + 64 * STATE * 8)
    assert engine.pool.num_blocks == 6
    assert run(engine, prompts) == want
    assert engine.scheduler.num_preemptions > 0 and all_free(engine)


def test_64_concurrent_requests_with_aborts_leave_every_block_and_slot_free(tokenizer):
    engine = hybrid_engine(tokenizer, max_num_batched_tokens=64)
    rng = random.Random(7)
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=10, ignore_eos=True, n=2)
    abort_at = {f"r{i}": rng.randrange(0, 60) for i in rng.sample(range(64), 24)}  # waiting, prefilling, decoding

    def abort_some(engine, step):
        for rid, when in abort_at.items():
            if when == step:
                engine.abort(rid)

    got = run(engine, [prompt(100 + i, rng.randrange(5, 60)) for i in range(64)], params, on_step=abort_some)
    assert sum(len(t) == 10 for t in got.values()) >= 64  # the requests not aborted ran to the end
    assert all_free(engine) and engine.pool.num_free == engine.pool.num_blocks


def test_prefix_caching_is_off_for_a_hybrid_model(tokenizer):
    engine = hybrid_engine(tokenizer, enable_prefix_caching=True)
    p = prompt(30, 70)
    engine.add_request("a", p, GREEDY)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    engine.add_request("b", p, GREEDY)
    while engine.has_unfinished():
        outs += engine.step()
    stats = engine.stats()
    assert not stats.prefix_caching and not engine.pool.enable_caching
    assert {o.num_cached_tokens for o in outs} == {0} and stats.prefix_cache_hits == 0


def test_the_state_slots_come_out_of_the_kv_budget(tokenizer):
    state = 64 * STATE * 8  # max_num_seqs slots
    engine = hybrid_engine(tokenizer, kv_cache_bytes=state + 10 * KV_BLOCK_BYTES)
    assert engine.pool.num_blocks == 10 and engine.states.num_slots == 64 and engine.state_bytes == state
    with pytest.raises(InferoError, match="--max-num-seqs 64 sequences takes 0 MiB of the 0 MiB budget; lower"):
        hybrid_engine(tokenizer, kv_cache_bytes=state + KV_BLOCK_BYTES - 1)
