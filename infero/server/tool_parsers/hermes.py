"""Hermes-style tool calls (Hermes 2 Pro, Qwen2.5, Qwen3): each call is a JSON object between tags,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

possibly several (parallel calls), possibly after some content. The closing tag of the last call may be missing
(generation stopped at the end-of-turn token). Text between and after calls is content too.
"""

from infero.server.tool_parsers.base import (
    MalformedToolCall,
    ParsedToolCalls,
    StreamingToolParser,
    TagScanner,
    ToolParser,
    read_call,
    skip_space,
)

START = "<tool_call>"
END = "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"

    def parse(self, text: str) -> ParsedToolCalls:
        if START not in text:
            return ParsedToolCalls(text or None)
        try:
            return _parse_calls(text)
        except MalformedToolCall:
            return ParsedToolCalls(text)

    def streaming_parser(self) -> "HermesStreamingParser":
        return HermesStreamingParser()


def _parse_calls(text: str) -> ParsedToolCalls:
    pieces, calls, pos = [], [], 0
    while pos < len(text):
        start = text.find(START, pos)
        piece = text[pos:] if start < 0 else text[pos:start]
        if calls:
            piece = piece.lstrip()
        if start < 0:
            pieces.append(piece)
            break
        pieces.append(piece.rstrip())
        call, end = read_call(text, skip_space(text, start + len(START)))
        calls.append(call)
        end = skip_space(text, end)
        if text.startswith(END, end):
            pos = end + len(END)
        elif END.startswith(text[end:]):  # no closing tag, or part of one, at the end of the text
            break
        else:
            raise MalformedToolCall(f"expected {END} after a tool call")
    return ParsedToolCalls("".join(pieces) or None, calls)


# Where the stream is.
_TEXT, _CALL_START, _IN_CALL, _AFTER_CALL = range(4)


class HermesStreamingParser(StreamingToolParser):
    def __init__(self) -> None:
        super().__init__()
        self._state = _TEXT
        self._start = TagScanner(START)
        self._end_partial = ""  # the part of END read so far after a call's JSON

    def _step(self, char: str) -> None:
        state = self._state
        if state == _TEXT:
            if self._text_char(char, self._start):
                self._state = _CALL_START
            return
        self._raw.append(char)
        if state == _CALL_START:
            if char.isspace():
                return
            self._begin_call()
            self._state = _IN_CALL
            if char != "{":
                raise MalformedToolCall("a tool call is a JSON object")
            self._call_char(char)
        elif state == _IN_CALL:
            if self._call_char(char):
                self._state = _AFTER_CALL
                self._end_partial = ""
        else:  # _AFTER_CALL: the call's JSON is complete; expect its closing tag
            if not self._end_partial and char.isspace():
                return
            self._end_partial += char
            if not END.startswith(self._end_partial):
                raise MalformedToolCall(f"expected {END} after a tool call")
            if self._end_partial == END:
                self._state = _TEXT
                self._skip_space = True

    def _finish(self) -> None:
        if self._state == _TEXT:
            self._content(self._start.flush())
        elif self._state != _AFTER_CALL:  # a call that never completed
            raise MalformedToolCall("the output ended inside a tool call")
