"""The offline API refuses what cannot fit the context before encoding all of it, like the server."""

import time

import pytest

from infero.engine.engine import EngineConfig
from infero.errors import ChatTemplateError, PromptTooLongError
from infero.llm import LLM

THIRTY_MB = "hello world " * (30_000_000 // 12)


@pytest.fixture(scope="module")
def llm(tiny_model_path) -> LLM:
    return LLM(tiny_model_path, device="cpu", engine_config=EngineConfig(kv_cache_bytes=1 << 20))


def test_a_thirty_megabyte_prompt_or_message_is_refused_in_well_under_a_second(llm):
    for encode in (lambda: llm.generate(THIRTY_MB), lambda: llm.encode_chat([{"role": "user", "content": THIRTY_MB}])):
        start = time.perf_counter()
        with pytest.raises(PromptTooLongError, match=r"has at least \d+ tokens; this model's context holds 256"):
            encode()
        assert time.perf_counter() - start < 1.0


def test_a_prompt_that_fills_the_context_is_refused_with_its_count_and_one_that_leaves_room_is_encoded(llm):
    text = "hello world " * 40
    while len(llm.tokenizer.encode(text + " hi")) < 256:
        text += " hi"
    assert llm.encode(text) == llm.tokenizer.encode(text)  # up to 255 tokens: room for one generated token
    ids = llm.tokenizer.encode(text + " hi")
    with pytest.raises(PromptTooLongError, match=f"the prompt has {len(ids)} tokens"):
        llm.encode(text + " hi")


def test_a_tool_whose_parameters_are_no_json_schema_is_refused_offline(llm):
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}
    with pytest.raises(ChatTemplateError, match="not a valid JSON Schema"):
        llm.encode_chat([{"role": "user", "content": "hi"}], tools=[tool])
