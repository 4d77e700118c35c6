"""Reasoning and tool calls in chat answers, streamed and not, from a "model" that writes a scripted text.

The tiny model's sampler is replaced by one that emits a fixed token sequence, so the whole server path (template,
engine, detokenizer, parsers, SSE) runs on an output we know.
"""

import inspect
import json

import pytest
from live_server import TEST_DEVICE, TINY_ENGINE

from infero.engine.sampling import SampleResult
from infero.llm import LLM

# A ChatML template that teaches neither tool calls nor reasoning: its parsers come from `infero serve
# --tool-call-parser hermes --reasoning-parser qwen3` (vLLM's flags), or there are none.
PLAIN_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') "
    "+ '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# The same with a system turn that teaches Hermes-style tool calls and <think> reasoning: the server picks both.
TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\\nThink in <think></think>, then call tools as "
    '<tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>\\n\' }}{% endif %}' + PLAIN_TEMPLATE
)
SCRIPT = '<think>\nI should add.\n</think>\n\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
ASK = [{"role": "user", "content": "1 + 2?"}]


def scripted_server(tiny_model_path, directory, template_text: str, script_text: str = SCRIPT, **settings):
    """A live server of the tiny model whose sampler writes `script_text`, under the given chat template and
    settings."""
    from live_server import start_server

    from infero.server.app import ServerSettings

    template = directory / "template.jinja"
    template.write_text(template_text)

    def load() -> LLM:
        llm = LLM(tiny_model_path, device=TEST_DEVICE, chat_template=template, engine_config=TINY_ENGINE)
        script = llm.tokenizer.encode(script_text, add_special_tokens=False)
        eos = llm.tokenizer.eos_token_id

        signature = inspect.signature(llm.engine.sampler.sample)

        class Scripted:  # a sampler with sample() only: the engine runs it on the host
            def sample(self, *args, **kwargs):
                output_ids = signature.bind(*args, **kwargs).arguments["output_ids"]
                return [SampleResult(script[len(out)] if len(out) < len(script) else eos, None, None)
                        for out in output_ids]  # fmt: skip

        llm.engine.sampler = Scripted()
        return llm

    return start_server(load, ServerSettings("tiny", **settings))


@pytest.fixture(scope="module")
def scripted(tiny_model_path, tmp_path_factory):
    live = scripted_server(tiny_model_path, tmp_path_factory.mktemp("template"), TEMPLATE)
    yield live
    live.stop()


def test_tool_calls_and_reasoning_are_split_out_of_the_text(scripted):
    r = scripted.client().chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=120)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.model_extra["reasoning_content"] == "I should add."
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "add"
    assert json.loads(call.function.arguments) == {"a": 1, "b": 2}


def test_streamed_tool_calls_add_up_to_the_same_message(scripted):
    full = scripted.client().chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=120)
    chunks = list(scripted.client().chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=120,
                                                            stream=True))  # fmt: skip
    reasoning, content, calls = "", "", {}
    for c in chunks:
        delta = c.choices[0].delta
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        content += delta.content or ""
        for call in delta.tool_calls or []:
            entry = calls.setdefault(call.index, {"id": None, "name": "", "arguments": ""})
            entry["id"] = entry["id"] or call.id
            entry["name"] += call.function.name or ""
            entry["arguments"] += call.function.arguments or ""
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert reasoning == full.choices[0].message.model_extra["reasoning_content"] and content == ""
    [call] = full.choices[0].message.tool_calls
    assert calls[0]["name"] == call.function.name and calls[0]["arguments"] == call.function.arguments
    assert calls[0]["id"].startswith("call_")


@pytest.mark.parametrize("tool_choice", [None, "none"])
def test_without_tools_on_offer_a_tool_call_stays_content(scripted, tool_choice):
    tools = {} if tool_choice is None else {"tools": TOOLS, "tool_choice": tool_choice}
    r = scripted.client().chat.completions.create(model="tiny", messages=ASK, max_tokens=120, **tools)
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert choice.message.content == SCRIPT[SCRIPT.index("<tool_call>") :]
    assert choice.message.model_extra["reasoning_content"] == "I should add."


@pytest.mark.parametrize("flags", [{}, {"tool_call_parser": "hermes", "reasoning_parser": "qwen3"}])
def test_the_parser_flags_give_a_template_that_teaches_none_its_parsers(tiny_model_path, tmp_path, flags):
    live = scripted_server(tiny_model_path, tmp_path, PLAIN_TEMPLATE, **flags)
    try:
        r = live.client().chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=120)
    finally:
        live.stop()
    choice = r.choices[0]
    if flags:
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls[0].function.name == "add"
        assert choice.message.model_extra["reasoning_content"] == "I should add."
    else:  # no parser: the text as the model wrote it
        assert choice.finish_reason == "stop" and not choice.message.tool_calls and choice.message.content == SCRIPT


# Qwen3-Coder / Qwen3.5: XML calls in Hermes' tags; the template's example of the format picks the qwen3_coder parser.
QWEN_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\\n<tool_call><function=f><|im_end|>\\n' }}{% endif %}" + PLAIN_TEMPLATE
)
QWEN_SCRIPT = ("Adding.\n<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n<parameter=b>\n2.5\n"
               "</parameter>\n<parameter=why>\nok\n</parameter>\n</function>\n</tool_call>")  # fmt: skip
QWEN_TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {
    "a": {"type": "integer"}, "b": {"type": "number"}, "why": {"type": "string"}}}}}]  # fmt: skip


def test_qwen3_coder_calls_are_tool_calls_typed_by_their_schema_whole_and_streamed(tiny_model_path, tmp_path):
    live = scripted_server(tiny_model_path, tmp_path, QWEN_TEMPLATE, QWEN_SCRIPT)
    try:
        client = live.client()
        r = client.chat.completions.create(model="tiny", messages=ASK, tools=QWEN_TOOLS, max_tokens=150)
        message = r.choices[0].message
        [call] = message.tool_calls
        assert message.content == "Adding." and r.choices[0].finish_reason == "tool_calls"
        assert call.function.name == "add" and json.loads(call.function.arguments) == {
            "a": 1,
            "b": 2.5,
            "why": "ok",
        }
        stream = client.chat.completions.create(model="tiny", messages=ASK, tools=QWEN_TOOLS, max_tokens=150,
                                                stream=True)  # fmt: skip
        content, arguments, names = "", "", []
        for chunk in stream:
            delta = chunk.choices[0].delta
            content += delta.content or ""
            for piece in delta.tool_calls or []:
                names += [piece.function.name] if piece.function.name else []
                arguments += piece.function.arguments or ""
        assert (content, names, arguments) == ("Adding.", ["add"], call.function.arguments)
    finally:
        live.stop()


TWO_CALLS = ('<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>\n'
             '<tool_call>\n{"name": "add", "arguments": {"a": 2}}\n</tool_call>')  # fmt: skip


def test_parallel_tool_calls_false_answers_a_choices_first_call_only(tiny_model_path, tmp_path):
    live = scripted_server(tiny_model_path, tmp_path, TEMPLATE, TWO_CALLS)
    try:
        client = live.client()

        def calls(**extra) -> tuple[list[str], list[str]]:
            r = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=125, **extra)
            whole = [c.function.arguments for c in r.choices[0].message.tool_calls]
            streamed: dict[int, str] = {}
            for chunk in client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=125,
                                                        stream=True, **extra):  # fmt: skip
                for piece in chunk.choices[0].delta.tool_calls or []:
                    streamed[piece.index] = streamed.get(piece.index, "") + (piece.function.arguments or "")
            return whole, list(streamed.values())

        assert calls() == (['{"a": 1}', '{"a": 2}'], ['{"a": 1}', '{"a": 2}'])
        assert calls(parallel_tool_calls=False) == (['{"a": 1}'], ['{"a": 1}'])
    finally:
        live.stop()
