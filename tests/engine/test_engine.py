"""The engine end to end on a tiny model: batching, preemption, chunked prefill and stop conditions."""

import pytest

from infero import LLM, SamplingParams
from infero.engine.engine import EngineConfig
from infero.errors import InferoError, PromptTooLongError

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


@pytest.mark.parametrize("prompt_len", [16, 21])  # a whole number of blocks, and a shared partial block
def test_n_choices_share_the_prefill_and_equal_separate_requests(llm, prompt_len):
    prompt = [(7 * i) % 250 + 3 for i in range(prompt_len)]
    params = SamplingParams(temperature=1.0, seed=40, max_tokens=12, ignore_eos=True, n=3)
    engine = llm.engine
    computed_before = engine.prompt_tokens_total
    outs = llm.generate([prompt], params)
    assert engine.prompt_tokens_total - computed_before == prompt_len  # the prompt counted (and run) once
    assert [o.completion_ids for o in outs] == [
        llm.generate([prompt], SamplingParams(temperature=1.0, seed=40 + j, max_tokens=12, ignore_eos=True))[
            0
        ].completion_ids
        for j in range(3)
    ]
    assert len({tuple(o.completion_ids) for o in outs}) == 3
    assert engine.pool.num_free == engine.pool.num_blocks


def test_forked_choices_hold_shared_blocks_once(llm):
    engine = llm.engine
    engine.add_request("fork", list(range(3, 35)), SamplingParams(temperature=0.5, n=4, max_tokens=5, seed=1))
    while not engine.step():  # prefill of 32 tokens = 2 full blocks (in chunks of the budget), then the fork
        pass
    running = [r for r in engine.scheduler.running if r.request_id == "fork"]
    assert len(running) == 4 and all(r.blocks[:2] == running[0].blocks[:2] for r in running)
    assert engine.pool.num_blocks - engine.pool.num_free == 2
    engine.abort("fork")
    assert engine.pool.num_free == engine.pool.num_blocks


def test_forks_never_run_more_sequences_than_max_num_seqs(tiny_model_path, llm):
    """Three sequences decode when a request of n = 4 completes its prompt under max_num_seqs 5: two of its choices
    join the running ones at once, the other two wait and recompute their prompt later (the step buffers and CUDA
    graphs are sized for max_num_seqs); every choice still gets its own seeded tokens."""
    small = LLM(tiny_model_path, engine_config=EngineConfig(max_num_seqs=5))
    engine = small.engine
    for i in range(3):
        engine.add_request(f"busy{i}", [5 + i] * 8, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    engine.step()
    params = SamplingParams(temperature=1.0, seed=7, n=4, max_tokens=6, ignore_eos=True)
    engine.add_request("fork", list(range(3, 20)), params)
    most, outputs = 0, {j: [] for j in range(4)}
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == "fork":
                outputs[out.index] += out.new_token_ids
        most = max(most, len(engine.scheduler.running))
    assert most == 5 and all(len(ids) == 6 for ids in outputs.values())
    for j in range(4):
        alone = SamplingParams(temperature=1.0, seed=7 + j, max_tokens=6, ignore_eos=True)
        assert outputs[j] == llm.generate([list(range(3, 20))], alone)[0].completion_ids
    assert engine.pool.num_free == engine.pool.num_blocks


def test_prompt_logprobs_equal_teacher_forced_log_softmax(tiny_model_path, tiny_model):
    import numpy as np

    from infero.engine.batch import SequenceStep, build_batch

    prompt = [(11 * i) % 280 + 3 for i in range(37)]
    model, backend = tiny_model
    cache = backend.allocate_kv_cache(model.config, 3, 16)
    logits = backend.forward(model, build_batch([SequenceStep(prompt, 0, [0, 1, 2], "all")], 16), cache)
    ref = (
        logits
        - np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1, keepdims=True))
        - logits.max(1, keepdims=True)
    )
    chunked = LLM(tiny_model_path, engine_config=EngineConfig(max_num_batched_tokens=10))
    [out] = chunked.generate([prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2))
    lps = out.prompt_logprobs
    assert lps[0] is None and len(lps) == len(prompt)
    for i in range(1, len(prompt)):
        assert lps[i].token_id == prompt[i]
        assert lps[i].logprob == pytest.approx(ref[i - 1, prompt[i]], abs=1e-4)
        assert [t for t, _ in lps[i].top] == list(np.argsort(-ref[i - 1], kind="stable")[:2])


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_a_prompt_gives_the_same_bits_however_it_is_chunked(tiny_model_path, llm, chunk):
    """Prompt logprobs (every position's logits) and the sampled tokens' logprobs, prefilled whole and in chunks of
    `chunk` tokens: bitwise equal, decodes (chunks of 1) included."""
    prompt = [(13 * i) % 270 + 3 for i in range(150)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3, prompt_logprobs=3)
    [whole] = llm.generate([prompt], params)
    chunked = LLM(tiny_model_path, engine_config=EngineConfig(max_num_batched_tokens=chunk))
    [out] = chunked.generate([prompt], params)
    assert out.completion_ids == whole.completion_ids
    assert out.prompt_logprobs == whole.prompt_logprobs and out.logprobs == whole.logprobs


def test_structured_output_is_well_formed_for_every_choice(llm):
    import json

    import jsonschema

    from infero.engine.structured import StructuredOutput

    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "n": {"type": "integer", "minimum": 0, "maximum": 999},
        },
        "required": ["name", "n"],
        "additionalProperties": False,
    }
    params = SamplingParams(
        temperature=1.0, seed=3, max_tokens=100, n=3, structured=StructuredOutput.json_schema(schema)
    )
    for out in llm.generate(["hello"], params):
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), schema)
    [choice] = llm.generate(
        ["hello"], SamplingParams(temperature=1.0, seed=4, structured=StructuredOutput.choice(["yes", "no"]))
    )
    assert choice.text in ("yes", "no") and choice.finish_reason == "stop"


def test_invalid_schema_is_rejected_when_the_request_arrives(llm):
    from infero.engine.structured import StructuredOutput
    from infero.errors import InferoError

    with pytest.raises(InferoError):
        llm.engine.add_request("bad", [5, 6], SamplingParams(structured=StructuredOutput.regex("(unclosed")))
    assert not llm.engine.has_unfinished()


def test_priority_scheduling_runs_the_most_urgent_first_with_the_same_tokens(tiny_model_path, llm):
    """vLLM's priority policy: with one sequence at a time, requests finish in (priority, arrival) order; each
    request's tokens are what it gets alone. Under fcfs a priority is refused, never silently ignored."""
    expected = [o.completion_ids for o in llm.generate(PROMPTS, GREEDY)]
    ranked = LLM(tiny_model_path, engine_config=EngineConfig(max_num_seqs=1, scheduling_policy="priority"))
    engine, finished = ranked.engine, []
    for i, (prompt, priority) in enumerate(zip(PROMPTS, [3, -2, 3, 0], strict=True)):
        engine.add_request(f"r{i}", ranked.encode(prompt), GREEDY, priority=priority)
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                finished.append(out.request_id)
    assert finished == ["r1", "r3", "r0", "r2"]
    assert [tokens[f"r{i}"] for i in range(4)] == expected
    assert [o.completion_ids for o in ranked.generate(PROMPTS, GREEDY, priority=[1, 0, 0, 2])] == expected
    with pytest.raises(InferoError, match="scheduling-policy priority"):
        llm.generate(PROMPTS[:1], GREEDY, priority=[1])
    with pytest.raises(InferoError, match="2 values for 1 prompts"):
        ranked.generate(PROMPTS[:1], GREEDY, priority=[1, 2])
