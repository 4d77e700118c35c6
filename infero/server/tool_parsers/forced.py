"""Tool calls that `tool_choice` forces: decoding is constrained to a JSON grammar, so the call is well formed
even from a model whose template knows nothing of tools.

- a named function: the output is exactly that function's arguments object (its `parameters` schema);
- "required": the output is a JSON array of one or more `{"name": ..., "parameters": {...}}`, each name one of
  the offered tools with its own parameters schema (vLLM's encoding).
"""

from __future__ import annotations

import json
from typing import Any

from infero.engine.structured import StructuredOutput
from infero.server.tool_parsers.base import (
    DeltaMessage,
    DeltaToolCall,
    ParsedToolCalls,
    ToolCall,
    ToolParser,
    make_tool_call_id,
)

ANY_OBJECT = {"type": "object"}


def named_call_schema(parameters: dict[str, Any] | None) -> StructuredOutput:
    return StructuredOutput.json_schema(parameters or ANY_OBJECT)


def required_calls_schema(tools: list[dict[str, Any]]) -> StructuredOutput:
    variants = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t["function"]["name"]},
                "parameters": t["function"].get("parameters") or ANY_OBJECT,
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    return StructuredOutput.json_schema({"type": "array", "minItems": 1, "items": {"anyOf": variants}})


class NamedToolParser(ToolParser):
    """The whole output is the named function's arguments."""

    name = "named"

    def __init__(self, function: str):
        self.function = function

    def parse(self, text: str) -> ParsedToolCalls:
        return ParsedToolCalls(None, [ToolCall(make_tool_call_id(), self.function, text)])

    def streaming_parser(self) -> _NamedStream:
        return _NamedStream(self.function)


class _NamedStream:
    """Streams the arguments as they are generated: a header delta first, then argument fragments."""

    def __init__(self, function: str):
        self.function, self.num_tool_calls = function, 0

    def feed(self, delta_text: str) -> list[DeltaMessage]:
        if self.num_tool_calls == 0:
            self.num_tool_calls = 1
            return [DeltaMessage(tool_calls=[DeltaToolCall(0, make_tool_call_id(), self.function, delta_text)])]
        return [DeltaMessage(tool_calls=[DeltaToolCall(0, arguments=delta_text)])] if delta_text else []

    def finish(self) -> list[DeltaMessage]:
        return self.feed("") if self.num_tool_calls == 0 else []


class RequiredToolParser(ToolParser):
    """The output is a JSON array of calls; each becomes one tool call."""

    name = "required"

    def parse(self, text: str) -> ParsedToolCalls:
        try:
            calls = json.loads(text)
            return ParsedToolCalls(None, [
                ToolCall(make_tool_call_id(), c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in calls
            ])  # fmt: skip
        except (ValueError, TypeError, KeyError):  # cut short by max_tokens: not a complete array
            return ParsedToolCalls(text, [])

    def streaming_parser(self) -> _RequiredStream:
        return _RequiredStream(self)


class _RequiredStream:
    """Holds the array until it is complete (its calls are known only then), then emits every call at once."""

    def __init__(self, parser: RequiredToolParser):
        self.parser, self.text, self.num_tool_calls = parser, [], 0

    def feed(self, delta_text: str) -> list[DeltaMessage]:
        self.text.append(delta_text)
        return []

    def finish(self) -> list[DeltaMessage]:
        parsed = self.parser.parse("".join(self.text))
        self.num_tool_calls = len(parsed.tool_calls)
        if not parsed.tool_calls:
            return [DeltaMessage(content=parsed.content)] if parsed.content else []
        return [DeltaMessage(tool_calls=[DeltaToolCall(i, c.id, c.name, c.arguments)
                                         for i, c in enumerate(parsed.tool_calls)])]  # fmt: skip
