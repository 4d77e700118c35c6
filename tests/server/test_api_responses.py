"""POST /v1/responses (OpenAI's Responses API) through the official OpenAI SDK, against the tiny model served live."""

import re

import openai
import pytest
from live_server import TINY_ENGINE

from infero.llm import LLM

ENUM = {"type": "object", "properties": {"ok": {"enum": ["yes", "no"]}}, "required": ["ok"],
        "additionalProperties": False}  # fmt: skip
PICK = [{"type": "function", "name": "pick", "description": "pick one",
         "parameters": {"type": "object", "properties": {"c": {"enum": ["a", "b"]}}, "required": ["c"],
                        "additionalProperties": False}}]  # fmt: skip


def test_a_response_is_the_chat_completion_of_the_same_conversation(server):
    client = server.client()
    common = {"temperature": 0, "extra_body": {"ignore_eos": True}}
    r = client.responses.create(model="tiny", input="hello", max_output_tokens=7, **common)
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=7,
                                          **common)  # fmt: skip
    assert r.object == "response" and r.output_text == chat.choices[0].message.content
    assert re.fullmatch("resp_[0-9a-f]{32}", r.id) and re.fullmatch("msg_[0-9a-f]{32}_0", r.output[0].id)
    assert (r.status, r.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == 7
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    assert [item.type for item in r.output] == ["message"] and r.output[0].status == "incomplete"


def test_instructions_and_input_items_become_the_chat_messages(server):
    """instructions, a developer message, text parts, a function call and its output: the prompt is the chat
    template's rendering of the same conversation."""
    items = [
        {"role": "developer", "content": "be brief"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "pick"},
                                                         {"type": "input_text", "text": "one"}]},
        {"type": "function_call", "call_id": "call_1", "name": "pick", "arguments": '{"c": "a"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "picked a"},
    ]  # fmt: skip
    messages = [
        {"role": "system", "content": "you are tiny\n\nbe brief"},  # the instructions and leading developer text
        {"role": "user", "content": "pick\none"},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "pick", "arguments": '{"c": "a"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "picked a"},
    ]  # fmt: skip
    r = server.client().responses.create(model="tiny", instructions="you are tiny", input=items, max_output_tokens=2)
    expected = server.http().post("/tokenize", json={"messages": messages}).json()["count"]
    assert r.usage.input_tokens == expected


def test_text_format_and_a_named_function_constrain_the_output(server):
    client = server.client()
    fmt = {"format": {"type": "json_schema", "name": "answer", "schema": ENUM}}
    r = client.responses.create(model="tiny", input="hello", max_output_tokens=40, text=fmt)
    assert r.status == "completed" and r.output_text in ('{"ok": "yes"}', '{"ok": "no"}')
    named = {"type": "function", "name": "pick"}
    r = client.responses.create(model="tiny", input="pick", tools=PICK, tool_choice=named, max_output_tokens=60)
    [call] = r.output
    assert (call.type, call.name, call.status, call.arguments in ('{"c": "a"}', '{"c": "b"}')) == (
        "function_call", "pick", "completed", True)  # fmt: skip
    assert call.call_id.startswith("call_") and r.tools[0].name == "pick"


@pytest.mark.parametrize("tool_choice", [None, {"type": "function", "name": "pick"}])
def test_a_streamed_response_is_the_same_response_as_events(server, tool_choice):
    client = server.client()
    kwargs = {"model": "tiny", "input": "pick", "max_output_tokens": 40, "temperature": 0,
              "text": {"format": {"type": "json_schema", "name": "answer", "schema": ENUM}}}  # fmt: skip
    if tool_choice is not None:
        kwargs.update(tools=PICK, tool_choice=tool_choice, text=None)
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:3]] == ["response.created", "response.in_progress", "response.output_item.added"]
    final = events[-1].response
    assert events[-1].type == "response.completed" and final.status == "completed"
    item, streamed = whole.output[0], final.output[0]
    if tool_choice is None:
        deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert deltas == whole.output_text == final.output_text
        done = [e.type for e in events[-4:-1]]
        assert done == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    else:
        deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
        assert deltas == item.arguments == streamed.arguments and streamed.name == "pick"
    assert final.usage.output_tokens == whole.usage.output_tokens


@pytest.mark.parametrize(
    "extra, param",
    [({"previous_response_id": "resp_1"}, "previous_response_id"),
     ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]}, "input"),
     ({"input": [{"type": "file_search_call", "id": "x"}]}, "input"),
     ({"tools": [{"type": "web_search"}]}, "tools"),
     ({"tool_choice": {"type": "web_search"}}, "tool_choice"),
     ({"text": {"format": {"type": "yaml"}}}, "text"),
     ({"input": []}, "input")],
)  # fmt: skip
def test_what_the_responses_api_has_and_infero_does_not_is_a_400(server, extra, param):
    body = {"model": "tiny", "input": "hello", "max_output_tokens": 2, **extra}
    r = server.http().post("/v1/responses", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    with pytest.raises(openai.NotFoundError):
        server.client().responses.create(model="other", input="hello")


def test_reasoning_is_an_output_item_of_its_own_whole_and_streamed(fresh_server, tiny_model_path, tmp_path):
    """A template whose generation prompt opens <think>: the tiny model never closes it, so all it writes is
    reasoning."""
    template = tmp_path / "think.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}"
                        "{% if add_generation_prompt %}<think>\n{% endif %}")  # fmt: skip
    load = lambda: LLM(tiny_model_path, device="cpu", engine_config=TINY_ENGINE, chat_template=template)  # noqa: E731
    live = fresh_server(load=load, reasoning_parser="think")
    client = live.client()
    kwargs = {"model": "tiny", "input": "hello", "max_output_tokens": 6, "temperature": 0,
              "extra_body": {"ignore_eos": True}}  # fmt: skip
    r = client.responses.create(**kwargs)
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=6,
                                          temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
    [item] = r.output
    assert item.type == "reasoning" and item.content[0].text == chat.choices[0].message.reasoning_content
    assert r.usage.output_tokens_details.reasoning_tokens == r.usage.output_tokens == 6  # all of it reasoning
    events = list(client.responses.create(stream=True, **kwargs))
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == item.content[0].text and events[-1].type == "response.incomplete"
    assert events[-1].response.output[0].content[0].text == deltas
    assert (
        events[-1].response.usage.output_tokens_details.reasoning_tokens
        == r.usage.output_tokens_details.reasoning_tokens
    )
