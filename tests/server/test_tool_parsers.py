"""Tool-call parsers: canned model outputs of each format, parsed whole and streamed in every possible split.

A stream's deltas are accumulated the way the OpenAI SDK does (content concatenated; per call index: id, type and
name from the first delta, `arguments` fragments concatenated), and the result must equal the non-streaming parse.
"""

import json
import random
import re
from pathlib import Path

import pytest

from infero.errors import InferoError
from infero.server.reasoning import get_reasoning_parser
from infero.server.tool_parsers import (
    DeltaMessage,
    DeltaToolCall,
    JsonWriter,
    MalformedToolCall,
    ParsedToolCalls,
    ToolCall,
    choose_tool_parser,
    get_tool_parser,
    make_tool_call_id,
)

CALL_ID = re.compile(r"call_[A-Za-z0-9]{24}")
FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "chat_templates"


# --- helpers ---------------------------------------------------------------------------------------------------------


def splits(text: str):
    """The text whole, in two pieces at every position, and one character at a time."""
    yield [text]
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]
    yield list(text)


def stream(parser, pieces: list[str]) -> list[dict]:
    streaming = parser.streaming_parser()
    deltas: list[DeltaMessage] = []
    for piece in pieces:
        deltas += streaming.feed(piece)
    deltas += streaming.finish()
    return [delta.to_openai() for delta in deltas]


def accumulate(deltas: list[dict]) -> tuple[str | None, list[tuple[str, str]]]:
    """Concatenate deltas as the OpenAI SDK does, checking each has the shape OpenAI streams."""
    content, calls = [], []
    for delta in deltas:
        assert len(delta) == 1, delta  # content or tool calls, never an empty delta
        if "content" in delta:
            assert isinstance(delta["content"], str) and delta["content"], delta
            content.append(delta["content"])
            continue
        (call,) = delta["tool_calls"]
        index = call["index"]
        if index == len(calls):  # the first delta of a call
            assert set(call) == {"index", "id", "type", "function"}, call
            assert CALL_ID.fullmatch(call["id"]) and call["type"] == "function", call
            assert set(call["function"]) == {"name", "arguments"}, call
            assert call["function"]["name"] and isinstance(call["function"]["arguments"], str)
            calls.append([call["function"]["name"], call["function"]["arguments"]])
        else:
            assert index == len(calls) - 1, "fragments continue the latest call"
            assert set(call) == {"index", "function"} and set(call["function"]) == {"arguments"}, call
            assert call["function"]["arguments"], "no empty fragments"
            calls[index][1] += call["function"]["arguments"]
    return ("".join(content) or None), [tuple(call) for call in calls]


def summary(parsed: ParsedToolCalls) -> tuple[str | None, list[tuple[str, str]]]:
    for call in parsed.tool_calls:
        assert CALL_ID.fullmatch(call.id)
    return parsed.content, [(call.name, call.arguments) for call in parsed.tool_calls]


def assert_streams_like_parse(parser, text: str) -> None:
    expected = summary(parser.parse(text))
    for pieces in splits(text):
        assert accumulate(stream(parser, pieces)) == expected, pieces


def args(obj) -> str:
    return json.dumps(obj, ensure_ascii=False)


HERMES = get_tool_parser("hermes")
LLAMA = get_tool_parser("llama3_json")

# Arguments that stress the JSON reading: braces and quotes inside strings, nesting, escapes, raw control characters.
NESTED = (
    '{"code": "def f():\\n    return {\\"a\\": [1, 2]}  # }", "filter": {"and": [{"x": {"$gt": 1}}, {"y": null}]},'
    ' "empty": {}, "list": [], "path": "C:\\\\dir\\/file", "tag": "</tool_call> <tool_call>"}'
)
NESTED_ARGS = args(json.loads(NESTED))
UNICODE = '{"city": "Zürich", "greeting": "こんにちは 👋", "escaped": "\\u00e9\\ud83d\\ude00", "lone": "\\ud800x"}'
UNICODE_ARGS = args(json.loads(UNICODE))
NUMBERS = '{"a":1.0,"b":1e3,"c":-0,"d":10,"e":2.50,"f":true,"g":false,"h":null,"i":-1.5E-2}'
NUMBERS_ARGS = '{"a": 1.0, "b": 1000.0, "c": 0, "d": 10, "e": 2.5, "f": true, "g": false, "h": null, "i": -0.015}'


# --- hermes ----------------------------------------------------------------------------------------------------------

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
WEATHER_CALL = ("get_weather", '{"city": "Paris", "unit": "celsius"}')
TIME = '{"name": "get_time", "arguments": {"timezone": "Europe/Paris"}}'
TIME_CALL = ("get_time", '{"timezone": "Europe/Paris"}')

HERMES_CASES = {
    "single call": (f"<tool_call>\n{WEATHER}\n</tool_call>", None, [WEATHER_CALL]),
    "parallel calls": (f"<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{TIME}\n</tool_call>", None,
                       [WEATHER_CALL, TIME_CALL]),
    "content before calls": (f"I'll check both.\n\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{TIME}\n"
                             "</tool_call>", "I'll check both.", [WEATHER_CALL, TIME_CALL]),
    "nested arguments": (f'<tool_call>\n{{"name": "run", "arguments": {NESTED}}}\n</tool_call>', None,
                         [("run", NESTED_ARGS)]),
    "non-ASCII": (f'<tool_call>\n{{"name": "greet", "arguments": {UNICODE}}}\n</tool_call>', None,
                  [("greet", UNICODE_ARGS)]),
    "numbers re-serialized": (f'<tool_call>{{"name":"calc","arguments":{NUMBERS}}}</tool_call>', None,
                              [("calc", NUMBERS_ARGS)]),
    "arguments before name": ('<tool_call>\n{"arguments": {"x": [1, 2]}, "name": "f"}\n</tool_call>', None,
                              [("f", '{"x": [1, 2]}')]),
    "no arguments": ('<tool_call>\n{"name": "now"}\n</tool_call>', None, [("now", "{}")]),
    "extra keys ignored": ('<tool_call>{"id": 7, "name": "f", "arguments": {}, "x": [1]}</tool_call>', None,
                           [("f", "{}")]),
    "closing tag missing at the end": (f"<tool_call>\n{WEATHER}\n", None, [WEATHER_CALL]),
    "closing tag cut off at the end": (f"<tool_call>\n{WEATHER}\n</tool_", None, [WEATHER_CALL]),
    "after reasoning (Qwen3)": (f"\n\n<tool_call>\n{WEATHER}\n</tool_call>", None, [WEATHER_CALL]),
    "raw newline inside a string": ('<tool_call>{"name": "f", "arguments": {"code": "a\n\tb"}}</tool_call>', None,
                                    [("f", '{"code": "a\\n\\tb"}')]),
    "content between and after calls": (f"A <tool_call>{WEATHER}</tool_call> B <tool_call>{TIME}</tool_call>\n"
                                        "That's all.\n", "ABThat's all.\n", [WEATHER_CALL, TIME_CALL]),
    "parameters instead of arguments": ('<tool_call>{"name": "f", "parameters": {"a": 1}}</tool_call>', None,
                                        [("f", '{"a": 1}')]),
    "a tag that is not one": (f"1 < 2 <tool <tool_cal\n<tool_call>{TIME}</tool_call>", "1 < 2 <tool <tool_cal",
                              [TIME_CALL]),
}  # fmt: skip


@pytest.mark.parametrize("case", HERMES_CASES)
def test_hermes_parses_canned_outputs(case):
    text, content, calls = HERMES_CASES[case]
    assert summary(HERMES.parse(text)) == (content, calls)


@pytest.mark.parametrize("case", HERMES_CASES)
def test_hermes_stream_split_anywhere_equals_parse(case):
    assert_streams_like_parse(HERMES, HERMES_CASES[case][0])


HERMES_MALFORMED = {
    "not JSON": "Sure.\n<tool_call>\nnot json\n</tool_call>",
    "unquoted key": '<tool_call>{name: "f"}</tool_call>',
    "array, not object": "<tool_call>[1, 2]</tool_call>",
    "broken before the name": '<tool_call>{"arguments": {"x": 1,}, "name": "f"}</tool_call>',
    "no name": '<tool_call>{"arguments": {"x": 1}}</tool_call>',
    "name not a string": '<tool_call>{"name": 5, "arguments": {}}</tool_call>',
    "empty name": '<tool_call>{"name": "", "arguments": {}}</tool_call>',
    "repeated key": '<tool_call>{"arguments": {"a": 1, "a": 2}, "name": "f"}</tool_call>',
    "NaN": '<tool_call>{"arguments": {"a": NaN}, "name": "f"}</tool_call>',
    "both arguments and parameters": '<tool_call>{"arguments": {}, "parameters": {}, "name": "f"}</tool_call>',
    "cut off before the name": 'Let me look.\n\n<tool_call>\n{"na',
    "a tag mentioned in prose": "Wrap each call in a <tool_call> tag.",
    "empty tag": "<tool_call></tool_call>",
}


@pytest.mark.parametrize("case", HERMES_MALFORMED)
def test_hermes_malformed_call_is_returned_as_content(case):
    text = HERMES_MALFORMED[case]
    assert summary(HERMES.parse(text)) == (text, [])
    # the call broke before its name went out, so the stream agrees exactly
    for pieces in splits(text):
        assert accumulate(stream(HERMES, pieces)) == (text, []), pieces


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>\n{"name": "f", "arguments": {"x": "abc',  # cut off by max_tokens
        '<tool_call>\n{"name": "f", "arguments": {"x": 1,}}\n</tool_call>',  # broken after the name
    ],
)
def test_hermes_call_broken_after_its_name_streams_its_text_as_content(text):
    assert summary(HERMES.parse(text)) == (text, [])
    for pieces in splits(text):
        content, calls = accumulate(stream(HERMES, pieces))  # no exception, and nothing is lost
        assert content == text
        assert [name for name, _ in calls] == ["f"]


def test_hermes_text_after_a_complete_call_that_is_not_a_closing_tag_becomes_content():
    text = f"<tool_call>{WEATHER} oops</tool_call>"
    assert summary(HERMES.parse(text)) == (text, [])
    for pieces in splits(text):
        assert accumulate(stream(HERMES, pieces)) == (" oops</tool_call>", [WEATHER_CALL])


# --- llama3_json -----------------------------------------------------------------------------------------------------

L_WEATHER = '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}'

LLAMA_CASES = {
    "single call": (L_WEATHER, None, [WEATHER_CALL]),
    "python tag": (f"<|python_tag|>{L_WEATHER}", None, [WEATHER_CALL]),
    "semicolon-separated calls": (f'{L_WEATHER}; {{"name": "get_time", "parameters": {{"timezone": "Europe/Paris"}}}}',
                                  None, [WEATHER_CALL, TIME_CALL]),
    "python tag and three calls": ('<|python_tag|>{"name": "a", "parameters": {}};{"name": "b", "parameters": '
                                   '{"x": "};{"}} ;\n {"name": "c", "arguments": {"y": [1]}}', None,
                                   [("a", "{}"), ("b", '{"x": "};{"}'), ("c", '{"y": [1]}')]),
    "arguments instead of parameters": ('{"name": "f", "arguments": {"a": 1}}', None, [("f", '{"a": 1}')]),
    "Llama 3.2 type key": ('{"type": "function", "name": "f", "parameters": {"a": "b"}}', None,
                           [("f", '{"a": "b"}')]),
    "leading whitespace": (f"\n\n  {L_WEATHER}\n", None, [WEATHER_CALL]),
    "nested arguments": (f'{{"name": "run", "parameters": {NESTED}}}', None, [("run", NESTED_ARGS)]),
    "non-ASCII": (f'{{"name": "greet", "parameters": {UNICODE}}}', None, [("greet", UNICODE_ARGS)]),
    "numbers re-serialized": (f'{{"name":"calc","parameters":{NUMBERS}}}', None, [("calc", NUMBERS_ARGS)]),
    "trailing separator": (f"{L_WEATHER};\n", None, [WEATHER_CALL]),
    "text after the call": (f"{L_WEATHER}\n\nI called the weather tool.", "I called the weather tool.",
                            [WEATHER_CALL]),
    "text after a separator": (f"{L_WEATHER}; done", "done", [WEATHER_CALL]),
}  # fmt: skip

LLAMA_NOT_CALLS = {
    "prose": "The weather in Paris is sunny, 24 °C.",
    "prose with braces": "Use {name} as a placeholder; {x}.",
    "JSON answer": '{"answer": 42, "name": "x"}',
    "call not at the start": f"Here you go: {L_WEATHER}",
    "built-in tool call": '<|python_tag|>brave_search.call(query="weather Paris")',
    "python tag alone": "<|python_tag|>",
    "name after an unknown key": '{"city": "Paris", "name": "f", "parameters": {}}',
    "partial python tag": "<|python_ta",
    "whitespace only": " \n ",
    "broken before the name": '{"parameters": {"a": 1 2}, "name": "f"}',
}


@pytest.mark.parametrize("case", LLAMA_CASES)
def test_llama3_json_parses_canned_outputs(case):
    text, content, calls = LLAMA_CASES[case]
    assert summary(LLAMA.parse(text)) == (content, calls)


@pytest.mark.parametrize("case", LLAMA_CASES)
def test_llama3_json_stream_split_anywhere_equals_parse(case):
    assert_streams_like_parse(LLAMA, LLAMA_CASES[case][0])


@pytest.mark.parametrize("case", LLAMA_NOT_CALLS)
def test_llama3_json_output_that_is_not_a_call_is_content(case):
    text = LLAMA_NOT_CALLS[case]
    assert summary(LLAMA.parse(text)) == (text, [])
    for pieces in splits(text):
        assert accumulate(stream(LLAMA, pieces)) == (text, []), pieces


def test_llama3_json_call_cut_off_after_its_name_streams_its_text_as_content():
    text = '<|python_tag|>{"name": "f", "parameters": {"x": 1'
    assert summary(LLAMA.parse(text)) == (text, [])
    for pieces in splits(text):
        content, calls = accumulate(stream(LLAMA, pieces))
        assert content == text and [name for name, _ in calls] == ["f"]


def test_llama3_json_json_answer_is_released_at_its_first_key():
    streaming = LLAMA.streaming_parser()
    assert streaming.feed('{"answ') == []  # could still be a call
    assert [d.to_openai() for d in streaming.feed('er": 4')] == [{"content": '{"answer": 4'}]
    assert [d.to_openai() for d in streaming.feed("2}")] == [{"content": "2}"}]
    assert streaming.finish() == []


# --- streaming behaviour common to both ------------------------------------------------------------------------------


@pytest.mark.parametrize("parser", [HERMES, LLAMA], ids=lambda p: p.name)
def test_text_without_calls_streams_through_unchanged(parser):
    text = "Paris is the capital of France. 1 < 2, {braces}; a <b>tag</b>\n\nDone.  \n"
    assert summary(parser.parse(text)) == (text, [])
    for pieces in splits(text):
        assert accumulate(stream(parser, pieces)) == (text, [])


def test_hermes_holds_back_only_whitespace_and_what_may_start_a_tag():
    text = "Hello world, <b>bold</b> <tool text\n"
    streaming = HERMES.streaming_parser()
    released = ""
    for i, char in enumerate(text):
        released += "".join(d.content for d in streaming.feed(char))
        prefix = text[: i + 1]
        held = re.search(r"\s*(<t?o?o?l?)?$", prefix).group(0)  # trailing whitespace + a prefix of <tool_call>
        assert released == prefix[: len(prefix) - len(held)], prefix
    released += "".join(d.content for d in streaming.finish())
    assert released == text


def test_llama3_json_releases_prose_at_its_first_character():
    streaming = LLAMA.streaming_parser()
    assert streaming.feed("\n ") == []  # whitespace before a possible call
    assert [d.to_openai() for d in streaming.feed("H")] == [{"content": "\n H"}]
    for char in "ello <|python_tag|> {":
        assert [d.to_openai() for d in streaming.feed(char)] == [{"content": char}]
    assert streaming.finish() == []


def test_arguments_stream_as_they_are_generated():
    streaming = HERMES.streaming_parser()
    assert streaming.feed("<tool_call>\n") == []
    assert streaming.feed('{"name": "wri') == []  # the name is sent whole, once its string is complete
    (header,) = [d.to_openai() for d in streaming.feed('te", "arguments": {"text": "Once')]
    (call,) = header["tool_calls"]
    assert call["index"] == 0 and call["type"] == "function" and CALL_ID.fullmatch(call["id"])
    assert call["function"] == {"name": "write", "arguments": '{"text": "Once'}
    assert [d.to_openai() for d in streaming.feed(" upon")] == [
        {"tool_calls": [{"index": 0, "function": {"arguments": " upon"}}]}
    ]
    assert [d.to_openai() for d in streaming.feed('"}}\n</tool_call>')] == [
        {"tool_calls": [{"index": 0, "function": {"arguments": '"}'}}]}
    ]
    assert streaming.finish() == [] and streaming.num_tool_calls == 1


def test_the_first_delta_of_a_call_has_its_name_when_the_name_comes_last():
    streaming = HERMES.streaming_parser()
    deltas = streaming.feed('<tool_call>{"arguments": {"a": 1}, "name": "f"')
    assert [d.to_openai()["tool_calls"][0]["function"] for d in deltas] == [{"name": "f", "arguments": '{"a": 1}'}]


@pytest.mark.parametrize("seed", range(20))
def test_random_chunks_equal_parse(seed):
    rng = random.Random(seed)
    parser, cases = rng.choice([(HERMES, HERMES_CASES), (LLAMA, LLAMA_CASES)])
    text = cases[rng.choice(sorted(cases))][0]
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, min(12, len(text) - 1))))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    assert accumulate(stream(parser, pieces)) == summary(parser.parse(text))


def test_reasoning_then_tool_calls_streamed_equal_parse():
    """Qwen3: the reasoning parser's content feeds the tool parser."""
    think = get_reasoning_parser("qwen3")
    text = f"<think>\nThe user wants weather.\n</think>\n\nChecking.\n<tool_call>\n{WEATHER}\n</tool_call>"
    parsed = think.parse(text)
    expected = (parsed.reasoning_content, *summary(HERMES.parse(parsed.content)))
    assert expected == ("The user wants weather.", "Checking.", [WEATHER_CALL])
    for pieces in splits(text):
        reasoning_stream, tool_stream = think.streaming_parser(), HERMES.streaming_parser()
        reasoning, deltas = [], []
        for piece in [*pieces, None]:
            delta = reasoning_stream.feed(piece) if piece is not None else reasoning_stream.finish()
            reasoning.append(delta.reasoning_content or "")
            if delta.content:
                deltas += tool_stream.feed(delta.content)
        deltas += tool_stream.finish()
        assert ("".join(reasoning), *accumulate([d.to_openai() for d in deltas])) == expected


# --- the re-serializing JSON reader ----------------------------------------------------------------------------------


class _Collect(JsonWriter):
    def __init__(self):
        super().__init__()
        self.parts = []

    def _emit(self, text):
        self.parts.append(text)


def rewrite(text: str) -> str:
    writer = _Collect()
    for char in text:
        writer.feed(char)
    writer.finish()
    return "".join(writer.parts)


def random_value(rng: random.Random, depth: int = 0):
    kinds = ["int", "float", "str", "bool", "null"] + (["list", "dict"] * 2 if depth < 4 else [])
    kind = rng.choice(kinds)
    if kind == "int":
        return rng.choice([0, -1, 7, 10**20, -(10**3)])
    if kind == "float":
        return rng.choice([0.5, -2.25, 1e-7, 1.5e300, 3.0, 0.1 + 0.2])
    if kind == "str":
        alphabet = 'ab "\\/{}[],:\n\t\x00\x1f\x7fé€\u2028😀\ud800\udfff'
        return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 8)))
    if kind == "bool":
        return rng.choice([True, False])
    if kind == "null":
        return None
    if kind == "list":
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {random_value(rng, 99) if rng.random() < 0.3 else f"k{i}": random_value(rng, depth + 1)
            for i in range(rng.randint(0, 4))}  # fmt: skip


@pytest.mark.parametrize("seed", range(30))
def test_json_writer_rewrites_as_json_dumps_does(seed):
    rng = random.Random(seed)
    value = random_value(rng)
    if isinstance(value, dict):  # random_value may make a non-string key; keys of JSON objects are strings
        value = {str(k): v for k, v in value.items()}
    indent = rng.choice([None, 0, 2, "\t"])
    separators = rng.choice([None, (",", ":"), (" , ", " : ")])
    text = json.dumps(value, ensure_ascii=rng.random() < 0.5, indent=indent, separators=separators)
    text = f"\n {text}\r\n\t" if not isinstance(value, (int, float)) or isinstance(value, bool) else text
    assert rewrite(text) == json.dumps(json.loads(text, strict=False), ensure_ascii=False)


@pytest.mark.parametrize(
    "text",
    [
        '"\\ud83d\\ude00 \\uD83D\\uDE00 \\ud83d\\u0041 \\ud83d\\ud83d\\ude00 \\udc00\\ud800"',
        '"\\ud83d\\n \\ud83d"',
        '"raw \x00 \x1f \x7f controls and \u2028 separators"',
        "[1E400, -1e-400, 0.0, -0.0, 1.10, 12345678901234567890123, 5e-324]",
        '[[], {}, [[]], {"a": {}}, ""]',
    ],
)
def test_json_writer_edge_cases(text):
    assert rewrite(text) == json.dumps(json.loads(text, strict=False), ensure_ascii=False)


def test_json_writer_escapes_every_character_as_json_dumps():
    text = "".join(chr(c) for c in range(0x10000)) + "\U0001f600\U0010ffff"  # surrogates too, alone and paired
    for encoded in (json.dumps(text), json.dumps(text, ensure_ascii=False)):
        assert rewrite(encoded) == json.dumps(json.loads(encoded), ensure_ascii=False)


@pytest.mark.parametrize(
    "text",
    ['{"a": 1,}', "[1 2]", '{"a" 1}', "[01]", "[1.]", "[-]", "[.5]", "[tru]", "[nulls]", "NaN", '{"a": NaN}',
     "[-Infinity]", '"\\x"', '"\\u12G4"', '{"a": 1, "a": 2}', "[1]]", '"abc', "{", "]", "", "[1, 2", '{"a"}',
     "{1: 2}", "['a']", "[1,,2]", "[\u00a01]", "[1e]", "[+1]", "[0x10]"],
)  # fmt: skip
def test_json_writer_rejects_what_the_tool_parsers_reject(text):
    with pytest.raises(MalformedToolCall):
        rewrite(text)


# --- choosing, registry, result shapes -------------------------------------------------------------------------------


def template_source(name: str) -> str:
    return json.loads((FIXTURES / f"{name}.json").read_text())["source"]


@pytest.mark.parametrize(
    "template, parser",
    [("qwen3", "hermes"), ("qwen2.5", "hermes"), ("llama-3.1", "llama3_json"), ("chatml", None), ("mistral", None),
     ("smollm2", None), ("qwen2-vl", None)],
)  # fmt: skip
def test_choose_tool_parser_from_real_templates(template, parser):
    assert choose_tool_parser(template_source(template)) == parser


def test_choose_tool_parser_other_templates():
    assert choose_tool_parser(None) is None and choose_tool_parser("") is None
    llama_3_2 = '{%- if message.role == "ipython" %}Respond in the format {"name": function name, "parameters": ...}'
    assert choose_tool_parser(llama_3_2) == "llama3_json"
    qwen3_coder = "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>"
    assert choose_tool_parser(qwen3_coder) == "qwen3_coder"


def test_get_tool_parser_unknown_name_says_which_exist():
    with pytest.raises(InferoError, match="hermes, llama3_json"):
        get_tool_parser("mistral")


def test_tool_call_ids_look_like_openai_ones_and_differ():
    ids = {make_tool_call_id() for _ in range(100)}
    assert len(ids) == 100 and all(CALL_ID.fullmatch(i) for i in ids)
    parsed = HERMES.parse(f"<tool_call>{WEATHER}</tool_call><tool_call>{WEATHER}</tool_call>")
    assert parsed.tool_calls[0].id != parsed.tool_calls[1].id


def test_results_serialize_in_openai_shape():
    call = ToolCall("call_x", "f", '{"a": 1}')
    assert ParsedToolCalls("hi", [call]).to_openai() == {
        "content": "hi",
        "tool_calls": [{"id": "call_x", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}],
    }
    assert ParsedToolCalls("hi").to_openai() == {"content": "hi"}
    assert DeltaMessage(tool_calls=[DeltaToolCall(0, "call_x", "f", "")]).to_openai() == {
        "tool_calls": [{"index": 0, "id": "call_x", "type": "function", "function": {"name": "f", "arguments": ""}}]
    }
    assert DeltaMessage(tool_calls=[DeltaToolCall(1, arguments="{")]).to_openai() == {
        "tool_calls": [{"index": 1, "function": {"arguments": "{"}}]
    }
    assert DeltaMessage(content="x").to_openai() == {"content": "x"}


# --- qwen3_coder ---------------------------------------------------------------------------------------------------

TYPED = {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "ratio": {"type": "number"}, "whole": {"type": "number"},
    "metric": {"type": "boolean"}, "filter": {"type": "object"}, "tags": {"type": "array"}, "note": {"type": "string"},
    "count": {"type": "integer"}}}  # fmt: skip
QWEN = get_tool_parser("qwen3_coder").for_tools([
    {"type": "function", "function": {"name": "forecast", "parameters": TYPED}},
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}},
])  # fmt: skip


def qwen_call(name: str, **params: str) -> str:
    """A call as Qwen3-Coder's chat template writes one."""
    body = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


FORECAST = qwen_call("forecast", city="Paris", days="3")
FORECAST_CALL = ("forecast", '{"city": "Paris", "days": 3}')
QWEN_CASES = {
    "single call": (FORECAST, None, [FORECAST_CALL]),
    "typed values": (qwen_call("forecast", ratio="0.25", whole="2.0", metric="True", filter='{"a": [1, {"b": null}]}',
                               tags='["x", "y"]', note="null", count="many", extra="7"), None,
                     [("forecast", '{"ratio": 0.25, "whole": 2, "metric": true, "filter": {"a": [1, {"b": null}]}, '
                                   '"tags": ["x", "y"], "note": null, "count": "many", "extra": "7"}')]),
    "parallel calls, content before": (f"Checking.\n\n{FORECAST}\n{qwen_call('now')}", "Checking.",
                                       [FORECAST_CALL, ("now", "{}")]),
    "multi-line value with markup": (qwen_call("forecast", note="line 1\n<b>2</b> </param>\n\nline 3"), None,
                                     [("forecast", '{"note": "line 1\\n<b>2</b> </param>\\n\\nline 3"}')]),
    "unknown function: text values": (qwen_call("other", n="1"), None, [("other", '{"n": "1"}')]),
    "values that are not their type stay text": (qwen_call("forecast", days="3.5", ratio="inf", filter="[NaN]",
                                                           metric="yes"), None,
                                                 [("forecast", '{"days": "3.5", "ratio": "inf", "filter": "[NaN]", '
                                                               '"metric": "yes"}')]),
    "closing tag missing at the end": (FORECAST[: -len("</tool_call>")], None, [FORECAST_CALL]),
    "closing tag cut off at the end": (FORECAST[:-4], None, [FORECAST_CALL]),
    "content after a call": (f"{FORECAST}\nDone.", "Done.", [FORECAST_CALL]),
    "non-ASCII": (qwen_call("forecast", city="Zürich 👋"), None, [("forecast", '{"city": "Zürich 👋"}')]),
}  # fmt: skip


@pytest.mark.parametrize("case", QWEN_CASES)
def test_qwen3_coder_parses_canned_outputs(case):
    text, content, calls = QWEN_CASES[case]
    assert summary(QWEN.parse(text)) == (content, calls)


@pytest.mark.parametrize("case", QWEN_CASES)
def test_qwen3_coder_stream_split_anywhere_equals_parse(case):
    assert_streams_like_parse(QWEN, QWEN_CASES[case][0])


QWEN_MALFORMED = {
    "JSON in the tags (Hermes')": f"<tool_call>\n{WEATHER}\n</tool_call>",
    "no function": "<tool_call>\n<parameter=x>\n1\n</parameter>\n</tool_call>",
    "empty name": "<tool_call>\n<function=>\n</function>\n</tool_call>",
    "cut off in the name": "Sure.\n<tool_call>\n<function=fore",
    "a tag mentioned in prose": "Wrap each call in a <tool_call> tag.",
}


@pytest.mark.parametrize("case", QWEN_MALFORMED)
def test_qwen3_coder_malformed_call_is_returned_as_content(case):
    text = QWEN_MALFORMED[case]
    assert summary(QWEN.parse(text)) == (text, [])
    for pieces in splits(text):
        assert accumulate(stream(QWEN, pieces)) == (text, []), pieces


BROKEN_AFTER_NAME = [FORECAST[:70], qwen_call("forecast", city="a", days="1").replace("<parameter=days", "<param=days")]


@pytest.mark.parametrize("text", BROKEN_AFTER_NAME)
def test_qwen3_coder_call_broken_after_its_name_streams_its_text_as_content(text):
    assert summary(QWEN.parse(text)) == (text, [])
    for pieces in splits(text):
        content, calls = accumulate(stream(QWEN, pieces))
        assert content == text and [name for name, _ in calls] == ["forecast"]


def test_qwen3_coder_streams_each_parameter_when_it_closes():
    streaming = QWEN.streaming_parser()
    [header] = [d.to_openai() for d in streaming.feed("<tool_call>\n<function=forecast>\n<parameter=city>\nPar")]
    call = header["tool_calls"][0]
    assert (call["index"], call["function"]) == (0, {"name": "forecast", "arguments": ""})
    deltas = [d.to_openai() for d in streaming.feed("is\n</parameter>\n")]
    assert deltas == [{"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Paris"'}}]}]
    deltas = [d.to_openai() for d in streaming.feed("<parameter=days>\n3\n</parameter>\n</function>")]
    assert deltas == [{"tool_calls": [{"index": 0, "function": {"arguments": ', "days": 3}'}}]}]


FRAGMENTS = [
    *("<tool_call>", "</tool_call>", "<tool_", "</tool", "<|python_tag|>", "<|py", "{", "}", "[", "]", '"', "\\"),
    *("\\u", "d83d", "\\ude00", ":", ",", ";", " ", "\n", '"name"', '"arguments"', '"parameters"', '"type"', '"f"'),
    *("1", "-", ".", "e", "true", "nul", "é", "😀", "x", "Hello", '{"name": "f", "arguments": {"a": 1}}'),
    *('{"name": "g", "parameters": {"s": "}{\\""}}', '<tool_call>\n{"name": "h", "arguments": {}}\n</tool_call>'),
    *("<function=forecast>", "<function=", "<parameter=days>", "<parameter=", "</parameter>", "</function>", ">"),
    *("</param", "3", "<tool_call>\n<function=now>\n</function>\n</tool_call>"),
]


@pytest.mark.parametrize("seed", range(3))
def test_random_texts_stream_like_parse_unless_a_sent_call_broke(seed):
    """Whatever the text: no exception, deltas in OpenAI's shape, and the stream equals the parse whenever the parse
    found calls or the stream sent none (a stream differs only when a call broke after its name was sent)."""
    rng = random.Random(seed)
    for _ in range(1500):
        text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(0, 12)))
        cuts = sorted(rng.sample(range(1, len(text)), min(3, len(text) - 1))) if len(text) > 1 else []
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        for parser in (HERMES, LLAMA, QWEN):
            expected, streamed = summary(parser.parse(text)), accumulate(stream(parser, pieces))
            if expected[1] or not streamed[1]:
                assert streamed == expected, (parser.name, pieces)
