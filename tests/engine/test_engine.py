"""The engine end to end on a tiny model: batching, preemption, chunked prefill and stop conditions."""

import pytest

from infero import LLM, SamplingParams
from infero.engine.engine import EngineConfig
from infero.errors import PromptTooLongError

PROMPTS = ["hello world", "the and tion", "12 12 hello", "world world world the"]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
EOS = 2


@pytest.fixture(scope="module")
def llm(tiny_model_path):
    return LLM(tiny_model_path)


def test_batched_generation_equals_generation_alone(llm):
    together = llm.generate(PROMPTS, GREEDY)
    for prompt, out in zip(PROMPTS, together, strict=True):
        [alone] = llm.generate([prompt], GREEDY)
        assert out.completion_ids == alone.completion_ids and len(out.completion_ids) == 20
        assert out.finish_reason == "length"


def test_preemption_and_chunked_prefill_give_the_same_tokens(tiny_model_path, llm):
    expected = [o.completion_ids for o in llm.generate(PROMPTS, GREEDY)]
    block_bytes = llm.backend.kv_block_bytes(llm.config, 16)
    # Four requests of ~30 tokens need 8 blocks; 5 blocks force preemption, 8-token steps force chunking.
    small = LLM(tiny_model_path, engine_config=EngineConfig(kv_cache_bytes=5 * block_bytes, max_num_batched_tokens=8))
    got = [o.completion_ids for o in small.generate(PROMPTS, GREEDY)]
    assert got == expected
    assert small.engine.scheduler.num_preemptions > 0
    assert small.engine.pool.num_free == small.engine.pool.num_blocks


def test_stream_deltas_join_to_the_generated_text(llm):
    params = SamplingParams(temperature=0.9, seed=11, max_tokens=25, ignore_eos=True)
    [out] = llm.generate(["hello"], params)
    deltas = list(llm.stream("hello", params))
    assert "".join(d.new_text for d in deltas) == out.text
    assert [t for d in deltas for t in d.new_token_ids] == out.completion_ids
    assert deltas[-1].finished and not any(d.finished for d in deltas[:-1])


def test_seeded_sampling_is_reproducible_across_batches(llm):
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=15, ignore_eos=True)
    [alone] = llm.generate(["hello"], params)
    mixed = llm.generate(["hello", "world"], [params, SamplingParams(temperature=1.0, seed=6, max_tokens=9)])
    assert mixed[0].completion_ids == alone.completion_ids


def test_end_of_generation_token_stops(llm):
    [out] = llm.generate(["hello"], SamplingParams(temperature=0, logit_bias={EOS: 100.0}))
    assert out.completion_ids == [EOS] and out.text == "" and out.finish_reason == "stop"


def test_min_tokens_holds_back_eos(llm):
    [out] = llm.generate(["hello"], SamplingParams(temperature=0, logit_bias={EOS: 100.0}, min_tokens=3))
    assert out.completion_ids[3:] == [EOS] and EOS not in out.completion_ids[:3]


def test_stop_token_ids(llm):
    [free] = llm.generate(["hello"], GREEDY)
    stop_id = free.completion_ids[4]
    first = free.completion_ids.index(stop_id)
    [out] = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_id]))
    assert out.completion_ids == free.completion_ids[: first + 1] and out.finish_reason == "stop"


def test_stop_string_is_cut_and_never_leaked(llm):
    [free] = llm.generate(["hello"], GREEDY)
    stop = free.text[5:8]
    [out] = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=20, stop=[stop], ignore_eos=True))
    assert out.finish_reason == "stop" and out.text == free.text[: free.text.index(stop)]
    streamed = "".join(d.new_text for d in llm.stream("hello", SamplingParams(temperature=0, max_tokens=20,
                                                                           stop=[stop], ignore_eos=True)))  # fmt: skip
    assert streamed == out.text


def test_context_limit_and_prompt_too_long(llm):
    n = llm.engine.max_model_len
    ids = [5] * (n - 3)
    [out] = llm.generate([ids], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    assert len(out.completion_ids) == 3 and out.finish_reason == "length"
    with pytest.raises(PromptTooLongError):
        llm.generate([[5] * n], GREEDY)


def test_abort_returns_blocks(llm):
    engine = llm.engine
    engine.add_request("a", [5] * 40, GREEDY)
    engine.step()
    assert engine.pool.num_free < engine.pool.num_blocks
    engine.abort("a")
    assert engine.pool.num_free == engine.pool.num_blocks and not engine.has_unfinished()


def test_text_ending_inside_a_character_is_not_lost(llm):
    lead_byte = llm.tokenizer.token_to_id("ä")  # byte-level symbol of 0xE4, the first byte of a CJK character
    params = SamplingParams(temperature=0, max_tokens=2, logit_bias={lead_byte: 100.0}, ignore_eos=True)
    [out] = llm.generate(["hello"], params)
    assert out.completion_ids == [lead_byte, lead_byte]
    assert out.text == llm.tokenizer.decode(out.completion_ids) and out.text
