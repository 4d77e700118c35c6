"""The engine on the tiny Qwen3.5 hybrid (tests/fixtures/models/tiny-qwen35.gguf, scripts/make_qwen35_fixtures.py):
state slots across aborts, forks, preemption and chunked prefill give the tokens of a request run alone on a fresh
engine, and leave every KV block and state slot free."""

import random
from pathlib import Path

import pytest

from infero import LLM, SamplingParams
from infero.engine.engine import EngineConfig

QWEN35 = Path(__file__).parent.parent / "fixtures" / "models" / "tiny-qwen35.gguf"
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def load(**config) -> LLM:
    return LLM(QWEN35, device="cpu", engine_config=EngineConfig(**config))


def prompt(seed: int, n: int = 24) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 250) for _ in range(n)]


def tokens(llm, prompts, params=GREEDY) -> list[list[int]]:
    return [c.completion_ids for c in llm.generate(prompts, params)]


def all_free(llm) -> bool:
    stats = llm.engine.stats()
    return stats.state_slots_used == 0 and stats.kv_blocks_referenced == 0 and stats.num_running == 0


@pytest.fixture(scope="module")
def llm():
    return load()


def test_the_ready_line_prints_kv_tokens_and_state_slots(llm):
    line = llm.summary()
    slot_mib = llm.backend.state_bytes_per_slot(llm.config) * 64 / 2**20
    assert f"tokens, recurrent state {slot_mib:,.0f} MiB = 64 sequences (prefix caching off" in line
    assert f"= {llm.engine.kv_capacity_tokens:,} tokens" in line


def test_a_request_after_an_aborted_one_gives_its_fresh_engine_tokens(llm):
    want = tokens(load(), [prompt(1)])
    engine = llm.engine
    engine.add_request("gone", prompt(2), GREEDY)
    for _ in range(4):  # prefilled and a few tokens decoded: its slot holds a live state
        engine.step()
    engine.abort("gone")
    assert all_free(llm)
    assert tokens(llm, [prompt(1)]) == want


@pytest.mark.parametrize("budget", [1, 100, 130])
def test_chunked_prefill_gives_the_tokens_of_a_whole_prefill(llm, budget):
    prompts = [prompt(10 + i, 30 + 70 * i) for i in range(3)]
    want = tokens(load(max_num_batched_tokens=512), prompts)
    assert tokens(load(max_num_batched_tokens=budget), prompts) == want


def test_prompt_chunks_end_on_the_delta_rules_chunk_boundaries(llm):
    from infero.backends.cpu.delta_net import DELTA_RULE_CHUNK

    small = load(max_num_batched_tokens=100)
    assert small.engine.scheduler.prefill_alignment == DELTA_RULE_CHUNK == 64
    small.engine.add_request("long", prompt(7, 200), GREEDY)
    computed = []
    while small.engine.has_unfinished():
        small.engine.step()
        computed.append(small.engine.scheduler.running[0].num_computed_tokens if small.engine.scheduler.running else 0)
    assert computed[:3] == [64, 128, 200]  # a budget of 100 cut back to a whole chunk; the last 72 end the prompt


def test_forks_continue_from_the_parents_state(llm):
    p = prompt(3)
    [alone] = tokens(llm, [p])
    assert tokens(llm, [p], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, n=3)) == [alone] * 3
    # A seeded choice j samples with seed + j: the fork's continuation is the request's with that seed, alone.
    seeded = SamplingParams(temperature=1.0, seed=5, max_tokens=10, ignore_eos=True, n=2)
    [_, second] = tokens(llm, [p], seeded)
    assert second == tokens(llm, [p], SamplingParams(temperature=1.0, seed=6, max_tokens=10, ignore_eos=True))[0]
    assert all_free(llm)


def test_asynchronous_scheduling_gives_the_same_tokens(llm):
    prompts = [prompt(40 + i, 10 + 7 * i) for i in range(4)]
    params = SamplingParams(temperature=0.9, seed=2, max_tokens=10, ignore_eos=True, n=2)
    overlapped = load(async_scheduling=True)
    assert tokens(overlapped, prompts, params) == tokens(llm, prompts, params)
    assert all_free(overlapped)


def test_preemption_recomputes_from_a_fresh_slot(llm):
    prompts = [prompt(20 + i, 30) for i in range(4)]
    want = tokens(llm, prompts)
    block = llm.backend.kv_block_bytes(llm.config, 16)
    state = 64 * llm.backend.state_bytes_per_slot(llm.config)
    small = load(kv_cache_bytes=state + 5 * block)  # four sequences of 40 tokens need 12 blocks
    assert tokens(small, prompts) == want
    assert small.engine.scheduler.num_preemptions > 0 and all_free(small)


def test_64_concurrent_requests_with_aborts_leave_every_block_and_slot_free(llm):
    engine, rng = llm.engine, random.Random(4)
    abort_at = {f"c{i}": rng.randrange(0, 40) for i in rng.sample(range(64), 24)}
    for i in range(64):
        engine.add_request(f"c{i}", prompt(100 + i, rng.randrange(4, 40)), GREEDY)
    step = 0
    while engine.has_unfinished():
        for rid, when in abort_at.items():
            if when == step:
                engine.abort(rid)
        engine.step()
        step += 1
    assert all_free(llm) and engine.pool.num_free == engine.pool.num_blocks
    assert engine.states.num_free == engine.states.num_slots == 64
