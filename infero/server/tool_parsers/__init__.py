"""Tool-call parsers: find the calls a model wrote in its output text, whole or streamed.

`choose_tool_parser(template)` names the parser for a model from its chat template, `get_tool_parser(name)` gives
it. Each parser is stateless (`parse(text)`); `streaming_parser()` makes a stateful one for a streamed choice.
"""

from infero.errors import InferoError
from infero.server.tool_parsers.base import (
    DeltaMessage,
    DeltaToolCall,
    JsonWriter,
    MalformedToolCall,
    ParsedToolCalls,
    StreamingToolParser,
    ToolCall,
    ToolParser,
    make_tool_call_id,
)
from infero.server.tool_parsers.hermes import HermesToolParser
from infero.server.tool_parsers.llama3_json import Llama3JsonToolParser
from infero.server.tool_parsers.qwen3_coder import Qwen3CoderToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    HermesToolParser.name: HermesToolParser,
    Llama3JsonToolParser.name: Llama3JsonToolParser,
    Qwen3CoderToolParser.name: Qwen3CoderToolParser,
}

__all__ = [
    "TOOL_PARSERS",
    "DeltaMessage",
    "DeltaToolCall",
    "HermesToolParser",
    "JsonWriter",
    "Llama3JsonToolParser",
    "MalformedToolCall",
    "ParsedToolCalls",
    "Qwen3CoderToolParser",
    "StreamingToolParser",
    "ToolCall",
    "ToolParser",
    "choose_tool_parser",
    "get_tool_parser",
    "make_tool_call_id",
]


def get_tool_parser(name: str) -> ToolParser:
    """The parser called `name`; raise InferoError naming the known ones otherwise."""
    if name not in TOOL_PARSERS:
        raise InferoError(f"unknown tool-call parser {name!r}; choose one of: {', '.join(sorted(TOOL_PARSERS))}")
    return TOOL_PARSERS[name]()


def choose_tool_parser(chat_template: str | None) -> str | None:
    """The parser for the format a chat template teaches its model, or None when it teaches none we read."""
    if not chat_template:
        return None
    if "<tool_call>" in chat_template:
        # Qwen3-Coder, Qwen3-Next and Qwen3.5 wrap XML (<function=name><parameter=...>) in Hermes' tags
        return Qwen3CoderToolParser.name if "<function=" in chat_template else HermesToolParser.name
    if "<|python_tag|>" in chat_template:
        return Llama3JsonToolParser.name
    if '"parameters"' in chat_template and "ipython" in chat_template:  # Llama 3.2's template has no python_tag
        return Llama3JsonToolParser.name
    return None
