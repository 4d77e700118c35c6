"""Asynchronous scheduling (step k + 1 queued before step k's tokens are read, its inputs fed from step k's
sampling) against the plain engine on the CPU backend: every output must be the same, the steps must really be
queued ahead where the engine says they can be, and no step may be wasted on a sequence at its length limit."""

import pytest

from infero import LLM, SamplingParams
from infero.engine.engine import PENDING, EngineConfig
from infero.engine.structured import StructuredOutput

PROMPTS = ["hello world", "the and tion", "12 12 hello", "world world world the"]
EOS = 2


def outputs(completions):
    return [(c.completion_ids, c.text, c.finish_reason, c.logprobs) for c in completions]


class Steps:
    """Counts the forward passes of an LLM's backend, and those whose input tokens were fed from the step before."""

    def __init__(self, llm):
        self.forwards = self.fed = 0
        forward = llm.backend.forward

        def counted(model, batch, cache, feed=None):
            self.forwards += 1
            self.fed += feed is not None
            if feed is None:
                assert PENDING not in batch.token_ids.tolist(), "a placeholder token reached a step without a feed"
            return forward(model, batch, cache, feed)

        llm.backend.forward = counted


@pytest.fixture(scope="module")
def plain(tiny_model_path):
    return LLM(tiny_model_path, engine_config=EngineConfig(async_scheduling=False, seed=3))


@pytest.fixture
def queued(tiny_model_path):
    return LLM(tiny_model_path, engine_config=EngineConfig(async_scheduling=True, seed=3))


def test_the_cpu_backend_does_not_queue_by_default(tiny_model_path):
    assert not LLM(tiny_model_path, device="cpu").engine.async_scheduling


CASES = {
    "greedy batch": (PROMPTS, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)),
    "seeded and unseeded sampling, logprobs": (
        PROMPTS,
        [
            SamplingParams(temperature=1.0, seed=5, max_tokens=15, ignore_eos=True, logprobs=3),
            SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=7, ignore_eos=True, logprobs=0),
            SamplingParams(temperature=1.2, top_k=5, min_p=0.05, max_tokens=18, ignore_eos=True),
        ],
    ),
    "n choices": (["hello"], SamplingParams(temperature=1.0, seed=40, max_tokens=12, ignore_eos=True, n=3)),
    "end of generation": (["hello", "world"], SamplingParams(temperature=0, logit_bias={EOS: 100.0}, max_tokens=9)),
    "min_tokens": (["hello"], SamplingParams(temperature=0, logit_bias={EOS: 100.0}, min_tokens=4, max_tokens=9)),
    "stop token ids and strings": (
        PROMPTS,
        [
            SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[5, 9, 17]),
            SamplingParams(temperature=0, max_tokens=20, stop=["e", " t"], ignore_eos=True),
            SamplingParams(temperature=0.7, seed=1, max_tokens=20, stop=["o"]),
            SamplingParams(temperature=0, max_tokens=3),
        ],
    ),
    "penalties (never queued ahead)": (
        PROMPTS[:2],
        SamplingParams(temperature=0, max_tokens=10, repetition_penalty=1.3, frequency_penalty=0.5, ignore_eos=True),
    ),
    "structured output (never queued ahead)": (
        ["hello"],
        SamplingParams(temperature=0.7, seed=2, max_tokens=30, structured=StructuredOutput.regex("[a-z]{3,8}")),
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_outputs_are_those_of_the_plain_engine(plain, queued, case):
    prompts, params = CASES[case]
    expected = outputs(plain.generate(prompts, params))
    steps = Steps(queued)
    assert outputs(queued.generate(prompts, params)) == expected
    assert (steps.fed == 0) == ("never queued" in case), f"{steps.fed} of {steps.forwards} steps queued ahead"
    engine = queued.engine
    assert engine.pool.num_free == engine.pool.num_blocks
    if engine.has_unfinished():  # a step queued after a sequence's last token: read and dropped
        assert engine.step() == []
    assert not engine.has_unfinished()


def test_decode_steps_are_queued_ahead_and_none_is_wasted_at_the_length_limit(queued):
    steps = Steps(queued)
    [out] = queued.generate(["hello world"], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    assert len(out.completion_ids) == 20
    # One prefill, then 19 decodes, each queued before the host read the token it takes (the first one behind
    # the prefill); the step after the 20th token is never launched.
    assert (steps.forwards, steps.fed) == (20, 19)


def test_a_sequence_that_stops_drops_the_token_of_the_step_queued_after(queued):
    steps = Steps(queued)
    [out] = queued.generate(["hello"], SamplingParams(temperature=0, logit_bias={EOS: 100.0}, min_tokens=3))
    assert len(out.completion_ids) == 4 and EOS not in out.completion_ids[:3] and out.completion_ids[3] == EOS
    assert out.finish_reason == "stop"
    assert steps.forwards == 5  # the step queued after the end-of-generation token ran; its token is dropped
    assert queued.engine.step() == [] and not queued.engine.has_unfinished()


def test_requests_arriving_mid_generation_and_preemption_give_the_same_tokens(tiny_model_path, plain):
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    expected = [o.completion_ids for o in plain.generate(PROMPTS, params)]
    block_bytes = plain.backend.kv_block_bytes(plain.config, 16)
    config = EngineConfig(async_scheduling=True, kv_cache_bytes=5 * block_bytes, max_num_batched_tokens=8)
    small = LLM(tiny_model_path, engine_config=config)
    engine, got = small.engine, {}
    for i, prompt in enumerate(PROMPTS):  # one new request every third step, while the others decode
        engine.add_request(str(i), small.tokenizer.encode(prompt), params)
        for _ in range(3):
            for out in engine.step():
                got.setdefault(int(out.request_id), []).extend(out.new_token_ids)
    while engine.has_unfinished():
        for out in engine.step():
            got.setdefault(int(out.request_id), []).extend(out.new_token_ids)
    assert [got[i] for i in range(len(PROMPTS))] == expected
    assert engine.scheduler.num_preemptions > 0 and engine.pool.num_free == engine.pool.num_blocks


def test_abort_with_a_step_queued_returns_the_blocks(queued):
    engine = queued.engine
    steps = Steps(queued)
    engine.add_request("a", [5] * 40, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    for _ in range(4):
        engine.step()
    assert steps.fed > 0 and engine.has_unfinished()
    engine.abort("a")
    assert engine.pool.num_free == engine.pool.num_blocks
    assert engine.step() == [] and not engine.has_unfinished()  # the queued step is read and dropped
