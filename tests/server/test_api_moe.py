"""A Qwen3-MoE model served on the CPU: streaming, n > 1, logprobs and chunked prefill as for dense models."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from live_server import TINY_ENGINE, start_server

from infero.llm import LLM
from infero.server.app import ServerSettings

MOE = Path(__file__).parent.parent / "fixtures" / "models" / "tiny-qwen3moe.gguf"
HELLO = [{"role": "user", "content": "hello there, the quick brown fox"}]
GREEDY = dict(model="moe", messages=HELLO, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})


def serve(engine_config=TINY_ENGINE):
    return start_server(lambda: LLM(MOE, device="cpu", engine_config=engine_config), ServerSettings("moe"))


@pytest.fixture(scope="module")
def moe_server():
    live = serve()
    yield live
    live.stop()


def test_streamed_text_is_the_whole_responses_text(moe_server):
    client = moe_server.client()
    whole = client.chat.completions.create(**GREEDY)
    assert whole.usage.completion_tokens == 8
    stream = client.chat.completions.create(**GREEDY, stream=True)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert streamed == whole.choices[0].message.content


def test_n_choices_with_logprobs(moe_server):
    client = moe_server.client()
    [single] = client.chat.completions.create(**GREEDY).choices
    r = client.chat.completions.create(**GREEDY, n=2, logprobs=True, top_logprobs=2)
    assert [c.message.content for c in r.choices] == [single.message.content] * 2
    for choice in r.choices:
        assert len(choice.logprobs.content) == 8
        for entry in choice.logprobs.content:  # greedy: the chosen token is the most probable
            assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob) and entry.logprob <= 0


def test_a_prompt_prefilled_in_small_chunks_gives_the_same_greedy_text(moe_server):
    want = moe_server.client().chat.completions.create(**GREEDY).choices[0].message.content
    chunked = serve(dataclasses.replace(TINY_ENGINE, max_num_batched_tokens=4))
    try:
        assert chunked.client().chat.completions.create(**GREEDY).choices[0].message.content == want
    finally:
        chunked.stop()
