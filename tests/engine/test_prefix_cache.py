"""Automatic prefix caching: content-addressed KV blocks in the pool, their reuse by the scheduler, and the engine's
outputs, which must not depend on whether a prompt's prefix was computed or found in the cache."""

import itertools
import random

import pytest

from infero import LLM, SamplingParams
from infero.engine.engine import EngineConfig
from infero.engine.kv_cache import BlockPool, block_hashes
from infero.engine.request import Request
from infero.engine.scheduler import Scheduler

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 250) for _ in range(n)]


SYSTEM = tokens(0, 70)  # four full blocks of 16 and 6 tokens more


class Outputs(list):
    """Each completion's (token ids, logprobs), compared exactly: a hit computes the prompt in two chunks (cached,
    then the rest), and the CPU backend gives the same bits however a prompt is chunked."""


def run(llm, prompts, params=GREEDY) -> Outputs:
    return Outputs((c.completion_ids, [lp.logprob for lp in c.logprobs or []]) for c in llm.generate(prompts, params))


def no_blocks_held(llm) -> bool:
    stats = llm.engine.stats()
    return stats.kv_blocks_referenced == 0 and llm.engine.pool.num_free == llm.engine.pool.num_blocks


class WriteGuard:
    """Wraps an LLM's backend forward: no new token's K/V may go into a block registered in the prefix cache."""

    def __init__(self, llm):
        pool, forward = llm.engine.pool, llm.backend.forward
        self.writes = 0

        def guarded(model, batch, cache, feed=None):
            for slot in batch.slot_mapping.tolist():
                assert not pool.is_registered(slot // pool.block_size), f"slot {slot} is in a cached block"
            self.writes += batch.num_tokens
            return forward(model, batch, cache, feed)

        llm.backend.forward = guarded


@pytest.fixture(scope="module")
def uncached(tiny_model_path):
    return LLM(tiny_model_path, engine_config=EngineConfig(enable_prefix_caching=False))


@pytest.fixture
def cached(tiny_model_path):
    return LLM(tiny_model_path)


# ---- the pool ------------------------------------------------------------------------------------------------


def test_block_hashes_chain_over_the_prefix_and_the_salt():
    a, b = tokens(1, 48), tokens(1, 32) + tokens(2, 16)
    ha, hb = block_hashes(None, a, 16), block_hashes(None, b, 16)
    assert len(ha) == 3 and ha[:2] == hb[:2] and ha[2] != hb[2]
    assert block_hashes(None, a[:47], 16) == ha[:2]  # a partly filled block has no hash
    assert block_hashes(ha[0], a[16:], 16) == ha[1:]  # continuing a chain gives the same hashes
    salted = block_hashes(None, a, 16, "tenant-a")
    assert not set(salted) & set(ha) and block_hashes(None, a, 16, "tenant-b")[0] != salted[0]


def test_freed_blocks_stay_cached_until_allocation_evicts_the_least_recently_used():
    pool = BlockPool(4, 16)
    first, second = pool.allocate(2), pool.allocate(2)
    hashes = block_hashes(None, tokens(3, 64), 16)
    for block, h in zip(first + second, hashes, strict=True):
        pool.register(block, h)
    pool.free(first)
    pool.free(second)  # used last: evicted last
    assert pool.num_free == 4 and pool.num_cached == 4 and pool.num_referenced == 0
    assert pool.cached_prefix(hashes) == first + second
    pool.allocate(1)  # second's tail went back after its head, so the first freed is first[1]
    assert pool.cached_prefix(hashes) == first[:1] and pool.num_cached == 3
    shared = pool.share(pool.cached_prefix(hashes))
    assert shared == first[:1] and pool.num_free == 2 and pool.num_referenced == 2


def test_a_block_without_a_hash_is_reused_before_any_cached_block():
    pool = BlockPool(3, 16)
    kept, scratch = pool.allocate(1), pool.allocate(1)
    [h] = block_hashes(None, tokens(4, 16), 16)
    pool.register(kept[0], h)
    pool.free(kept)
    pool.free(scratch)  # freed later, but holds nothing worth keeping
    assert pool.allocate(2) == [scratch[0], 2] and pool.cached_prefix([h]) == kept


def test_the_same_contents_computed_twice_keep_one_registered_block():
    pool = BlockPool(2, 16)
    a, b = pool.allocate(2)
    [h] = block_hashes(None, tokens(5, 16), 16)
    pool.register(a, h)
    pool.register(b, h)
    assert pool.is_registered(a) and not pool.is_registered(b) and pool.cached_prefix([h]) == [a]


# ---- the scheduler -------------------------------------------------------------------------------------------


def advance(chunks):
    for c in chunks:
        done = c.completes_prompt
        c.request.num_computed_tokens += c.num_tokens
        if done:
            c.request.output_ids.append(7)


def test_admission_starts_after_the_cached_blocks_and_always_computes_the_last_token():
    s = Scheduler(BlockPool(16, 16), max_num_batched_tokens=256)
    first = Request("a", tokens(6, 48), SamplingParams(), arrival=0)
    s.add(first)
    advance(s.schedule())
    s.finish(first, "stop")
    whole = Request("b", tokens(6, 48), SamplingParams(), arrival=1)  # three full blocks, all cached
    longer = Request("c", tokens(6, 48) + [9, 9], SamplingParams(), arrival=2)
    s.add(whole)
    s.add(longer)
    chunks = s.schedule()
    assert [(c.request, c.num_tokens) for c in chunks] == [(whole, 16), (longer, 2)]
    assert whole.blocks[:2] == longer.blocks[:2]
    assert whole.num_cached_tokens == 32 and longer.num_cached_tokens == 48
    assert whole.blocks[2] != longer.blocks[2]  # the cached third block is shared; whole recomputes its own
    assert (s.prefix_cache_queries, s.prefix_cache_hits) == (48 + 48 + 50, 0 + 32 + 48)


def test_waiting_for_blocks_takes_no_cached_block_and_counts_no_query():
    s = Scheduler(BlockPool(4, 16), max_num_batched_tokens=256)
    first = Request("a", tokens(7, 40), SamplingParams(), arrival=0)
    s.add(first)
    advance(s.schedule())
    s.finish(first, "stop")  # 2 cached blocks, 4 free
    hog = Request("h", tokens(8, 40), SamplingParams(), arrival=1)
    s.add(hog)
    advance(s.schedule())  # the block without a hash, the unused one, then the first's second block (evicted)
    assert s.pool.num_free == 1 and len(s.pool.cached_prefix(first.block_hashes)) == 1
    again = Request("b", tokens(7, 70), SamplingParams(), arrival=2)  # needs 5 blocks
    s.add(again)
    queries = s.prefix_cache_queries
    assert s.schedule()[-1].request is hog and again.blocks == [] and s.prefix_cache_queries == queries


# ---- the engine ----------------------------------------------------------------------------------------------


def test_a_hit_gives_the_same_tokens_and_logprobs_as_a_miss(cached, uncached):
    prompts = [SYSTEM + tokens(10 + i, 5 + 7 * i) for i in range(3)]
    expected = run(uncached, prompts)
    guard = WriteGuard(cached)
    assert run(cached, prompts[:1]) == expected[:1]
    computed = guard.writes
    assert run(cached, prompts[1:]) == expected[1:]
    stats = cached.engine.stats()
    assert stats.prefix_cache_hits == 2 * 64  # the system prompt's four full blocks, for each later prompt
    assert stats.prefix_cache_queries == sum(len(p) for p in prompts)
    assert guard.writes - computed == sum(len(p) - 64 for p in prompts[1:]) + 2 * 5  # 6 tokens: 5 decodes each
    assert no_blocks_held(cached) and stats.kv_blocks_cached > 0


def test_outputs_report_the_cached_prompt_tokens(cached):
    prompt = SYSTEM + [5, 6, 7]
    first = list(cached.stream(prompt, GREEDY))
    second = list(cached.stream(prompt, GREEDY))
    assert {o.num_cached_tokens for o in first} == {0}
    assert {o.num_cached_tokens for o in second} == {64}


def test_caching_off_computes_every_prompt(uncached):
    before = uncached.engine.stats()
    run(uncached, [SYSTEM, SYSTEM])
    after = uncached.engine.stats()
    assert after.prefix_cache_hits == before.prefix_cache_hits == 0 and after.kv_blocks_cached == 0
    assert after.prefix_cache_queries == 0


def test_cache_salt_keeps_tenants_apart(cached):
    engine, ids = cached.engine, itertools.count()

    def hits(salt):
        before = engine.stats().prefix_cache_hits
        engine.add_request(f"r{next(ids)}", SYSTEM, GREEDY, cache_salt=salt)
        while engine.has_unfinished():
            engine.step()
        return engine.stats().prefix_cache_hits - before

    assert hits("tenant-a") == 0
    assert hits("tenant-b") == 0
    assert hits(None) == 0
    assert hits("tenant-a") == 64 and hits(None) == 64


def test_prompt_logprobs_skip_the_cache_and_stay_complete(cached, uncached):
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2)
    run(cached, [SYSTEM])
    queries = cached.engine.stats().prefix_cache_queries
    [got] = cached.generate([SYSTEM], params)
    [expected] = uncached.generate([SYSTEM], params)
    assert got.prompt_logprobs == expected.prompt_logprobs and len(got.prompt_logprobs) == len(SYSTEM)
    assert cached.engine.stats().prefix_cache_queries == queries


def test_n_choices_over_a_cached_prefix_match_the_uncached_engine(cached, uncached):
    params = SamplingParams(temperature=1.0, seed=9, n=3, max_tokens=8, ignore_eos=True)
    prompt = SYSTEM + tokens(20, 9)
    expected = run(uncached, [prompt], params)
    guard = WriteGuard(cached)
    assert run(cached, [prompt], params) == expected
    assert run(cached, [prompt], params) == expected
    assert guard.writes > 0 and no_blocks_held(cached)


def test_eviction_under_memory_pressure_keeps_outputs_exact(tiny_model_path, uncached):
    block_bytes = uncached.backend.kv_block_bytes(uncached.config, 16)
    small = LLM(tiny_model_path, engine_config=EngineConfig(kv_cache_bytes=8 * block_bytes))
    guard = WriteGuard(small)
    others = [tokens(30 + i, 60) for i in range(4)]
    prompts = [SYSTEM, *others, SYSTEM]
    assert Outputs(run(small, [p])[0] for p in prompts) == [run(uncached, [p])[0] for p in prompts]
    # 8 blocks cannot keep the system prompt's 4 through 4 other prompts of 4 blocks each: it was evicted.
    assert small.engine.stats().prefix_cache_hits < 64
    assert no_blocks_held(small) and guard.writes > 0


def test_a_preempted_request_finds_its_blocks_again(tiny_model_path, uncached):
    block_bytes = uncached.backend.kv_block_bytes(uncached.config, 16)
    config = EngineConfig(kv_cache_bytes=9 * block_bytes, max_num_batched_tokens=32)
    small = LLM(tiny_model_path, engine_config=config)
    guard = WriteGuard(small)
    prompts = [tokens(40 + i, 40) for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    assert run(small, prompts, params) == run(uncached, prompts, params)
    stats = small.engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert no_blocks_held(small) and guard.writes > 0


def test_chunked_prefill_registers_blocks_for_a_later_request(tiny_model_path, uncached):
    chunked = LLM(tiny_model_path, engine_config=EngineConfig(max_num_batched_tokens=20))
    WriteGuard(chunked)
    prompts = [SYSTEM + [3], SYSTEM + [4]]
    assert Outputs(run(chunked, [p])[0] for p in prompts) == run(uncached, prompts)
    assert chunked.engine.stats().prefix_cache_hits == 64
