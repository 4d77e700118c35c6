"""Qwen3-Coder-style tool calls (Qwen3-Coder, Qwen3-Next, Qwen3.5): XML in the Hermes tags, one element a parameter,

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

Values are written as text (a string as it is, anything else as JSON); each is read back by the type the tool's
schema gives its parameter (integer, number, boolean, object / array, null), as vLLM's qwen3_coder parser reads
them, and the call's arguments are the JSON object of them. Content may come before, between and after calls; the
closing </tool_call> of the last call may be missing. A streamed call sends its name when `<function=...>` is read
and each parameter when its `</parameter>` is.
"""

from __future__ import annotations

import json
import math
from typing import Any

from infero.server.tool_parsers.base import (
    MalformedToolCall,
    ParsedToolCalls,
    StreamingToolParser,
    TagScanner,
    ToolCall,
    ToolParser,
    make_tool_call_id,
)

START, END = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"
MAX_NAME = 256  # characters of a function or parameter name: more is not a name


class Qwen3CoderToolParser(ToolParser):
    name = "qwen3_coder"

    def __init__(self, tools: list[dict] | None = None):
        """tools: the request's tools (OpenAI's shape), whose schemas type the parameters."""
        self.schemas = {}
        for tool in tools or []:
            function = tool.get("function", tool)
            parameters = function.get("parameters") if isinstance(function, dict) else None
            properties = parameters.get("properties") if isinstance(parameters, dict) else None
            self.schemas[function.get("name")] = properties if isinstance(properties, dict) else {}

    def for_tools(self, tools: list[dict] | None) -> Qwen3CoderToolParser:
        return Qwen3CoderToolParser(tools)

    def parse(self, text: str) -> ParsedToolCalls:
        """The streaming parser's reading of the whole text; the text as content where a call is malformed."""
        if START not in text:
            return ParsedToolCalls(text or None)
        stream = self.streaming_parser()
        deltas = stream.feed(text) + stream.finish()
        if stream.failed:
            return ParsedToolCalls(text)
        content, calls = [], []
        for delta in deltas:
            if delta.content is not None:
                content.append(delta.content)
            for piece in delta.tool_calls:
                if piece.id is not None:
                    calls.append(ToolCall(piece.id, piece.name, piece.arguments or ""))
                else:
                    calls[piece.index].arguments += piece.arguments
        return ParsedToolCalls("".join(content) or None, calls)

    def streaming_parser(self) -> Qwen3CoderStreamingParser:
        return Qwen3CoderStreamingParser(self.schemas)


def convert(value: str, schema: Any) -> Any:
    """A parameter's text as the value its schema types it (vLLM's qwen3_coder reading): "null" is None; integer,
    number, boolean and object / array values parse as such where they can, else stay text; no type is text."""
    if value.lower() == "null":
        return None
    kind = str(schema.get("type", "string")).strip().lower() if isinstance(schema, dict) else "string"
    if kind.startswith(("int", "uint", "long", "short", "unsigned")):
        try:
            return int(value)
        except ValueError:
            return value
    if kind.startswith(("num", "float")):
        try:
            number = float(value)
        except ValueError:
            return value
        if not math.isfinite(number):  # JSON has no infinity
            return value
        return int(number) if number.is_integer() else number
    if kind in ("boolean", "bool", "binary"):
        return value.lower() == "true" if value.lower() in ("true", "false") else value
    if kind in ("object", "array", "dict", "list"):
        try:
            return json.loads(value, parse_constant=_not_json)
        except ValueError:  # JSONDecodeError is one
            return value
    return value


def _not_json(name: str):
    raise ValueError(f"{name} is not JSON")


# Where the stream is.
_TEXT, _CALL, _NAME, _PARAMS, _KEY, _VALUE, _CALL_END = range(7)


class Qwen3CoderStreamingParser(StreamingToolParser):
    def __init__(self, schemas: dict[str, dict]) -> None:
        super().__init__()
        self._schemas = schemas
        self._state = _TEXT
        self._start = TagScanner(START)
        self._tag = ""  # the tag being read where one is expected
        self._name = ""  # the function's or the parameter's
        self._function = ""
        self._value: list[str] = []  # the parameter value's characters so far
        self._params: dict[str, Any] = {}

    @property
    def failed(self) -> bool:
        return self._passthrough

    def _step(self, char: str) -> None:
        state = self._state
        if state == _TEXT:
            if self._text_char(char, self._start):
                self._state, self._tag = _CALL, ""
            return
        self._raw.append(char)
        if state in (_CALL, _PARAMS, _CALL_END):
            self._expect_tag(char)
        elif state in (_NAME, _KEY):
            if char == ">":
                self._named()
            elif char == "\n" or len(self._name) >= MAX_NAME:
                raise MalformedToolCall("a name ends at >")
            else:
                self._name += char
        else:  # _VALUE
            self._value.append(char)
            if char == ">" and "".join(self._value[-len(PARAMETER_END) :]) == PARAMETER_END:
                self._parameter("".join(self._value[: -len(PARAMETER_END)]))

    def _expect_tag(self, char: str) -> None:
        """Between the elements of a call: whitespace, then the tags the state allows."""
        if not self._tag and char.isspace():
            return
        self._tag += char
        tags = {_CALL: (FUNCTION,), _PARAMS: (PARAMETER, FUNCTION_END), _CALL_END: (END,)}[self._state]
        if not any(tag.startswith(self._tag) for tag in tags):
            raise MalformedToolCall(f"expected {' or '.join(tags)}")
        if self._tag == FUNCTION:
            self._state, self._name = _NAME, ""
        elif self._tag == PARAMETER:
            self._state, self._name = _KEY, ""
        elif self._tag == FUNCTION_END:
            self._end_function()
        elif self._tag == END:
            self._state, self._skip_space, self._raw = _TEXT, True, []
        else:
            return
        self._tag = ""

    def _named(self) -> None:
        name = self._name.strip()
        if not name:
            raise MalformedToolCall("an empty name")
        if self._state == _NAME:
            self._out.tool_header(self.num_tool_calls, make_tool_call_id(), name, "")
            self.num_tool_calls += 1
            self._function, self._params, self._state = name, {}, _PARAMS
        else:
            self._state, self._value = _VALUE, []

    def _parameter(self, text: str) -> None:
        """A parameter's value is complete: its text without the newline the template writes on either side."""
        text = text[1:] if text.startswith("\n") else text
        text = text[:-1] if text.endswith("\n") else text
        key = self._name.strip()
        if key in self._params:
            raise MalformedToolCall(f"parameter {key!r} given twice")
        value = convert(text, self._schemas.get(self._function, {}).get(key))
        separator = "{" if not self._params else ", "
        self._params[key] = value
        self._out.tool_arguments(self.num_tool_calls - 1,
                                 separator + json.dumps(key, ensure_ascii=False) + ": " +
                                 json.dumps(value, ensure_ascii=False))  # fmt: skip
        self._state = _PARAMS

    def _end_function(self) -> None:
        self._out.tool_arguments(self.num_tool_calls - 1, "}" if self._params else "{}")
        self._state = _CALL_END

    def _finish(self) -> None:
        if self._state == _TEXT:
            self._content(self._start.flush())
        elif self._state != _CALL_END:  # a call that never completed (a missing </tool_call> alone is fine)
            raise MalformedToolCall("the output ended inside a tool call")
