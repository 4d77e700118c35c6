"""Llama 3.1 / 3.2 / 3.3 JSON tool calls: the whole reply is the call,

    {"name": "get_weather", "parameters": {"city": "Paris"}}

optionally after `<|python_tag|>` (when the tokenizer keeps that special token), with "arguments" instead of
"parameters" from some prompts, and a "type": "function" key from Llama 3.2. Several calls are separated by ";".

A reply is read as calls only if it starts (after whitespace) with `<|python_tag|>` or "{"; any other reply is
content. Text after the last call, or after a ";" that no call follows, is content. A top-level key other than
name, arguments, parameters and type means the object is not a call (it is the model answering in JSON), which a
stream can tell without waiting for the end of the object.
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

PYTHON_TAG = "<|python_tag|>"
CALL_KEYS = frozenset({"name", "arguments", "parameters", "type"})


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def parse(self, text: str) -> ParsedToolCalls:
        pos = skip_space(text, 0)
        if text.startswith(PYTHON_TAG, pos):
            pos = skip_space(text, pos + len(PYTHON_TAG))
        elif not text.startswith("{", pos):
            return ParsedToolCalls(text or None)
        try:
            return _parse_calls(text, pos)
        except MalformedToolCall:
            return ParsedToolCalls(text)

    def streaming_parser(self) -> "Llama3JsonStreamingParser":
        return Llama3JsonStreamingParser()


def _parse_calls(text: str, pos: int) -> ParsedToolCalls:
    calls = []
    while True:
        call, end = read_call(text, pos, CALL_KEYS)
        calls.append(call)
        pos = skip_space(text, end)
        if text.startswith(";", pos):
            pos = skip_space(text, pos + 1)
            if text.startswith("{", pos):
                continue
        return ParsedToolCalls(text[pos:] or None, calls)


# Where the stream is.
_START, _CALL_START, _IN_CALL, _AFTER_CALL, _AFTER_SEPARATOR = range(5)


class Llama3JsonStreamingParser(StreamingToolParser):
    def __init__(self) -> None:
        super().__init__(CALL_KEYS)
        self._state = _START
        self._tag = TagScanner(PYTHON_TAG)  # holds the leading whitespace too

    def _step(self, char: str) -> None:
        state = self._state
        if state == _START:
            if char == "{" and not self._tag.partial:
                self._raw = [self._tag.flush()]
                self._state = _CALL_START
            else:
                released, matched = self._tag.feed(char)
                if matched is not None:
                    self._raw = [matched]
                    self._state = _CALL_START
                elif released:  # the reply is not a call: all of it is content
                    self._content(released + self._tag.flush())
                    self._passthrough = True
                return
        elif state == _AFTER_CALL:
            if char.isspace():
                return
            if char == ";":
                self._state = _AFTER_SEPARATOR
                self._raw = [char]
            else:
                self._content(char)
                self._passthrough = True
            return
        elif state == _AFTER_SEPARATOR:
            if char == "{":
                self._state = _CALL_START
            elif not char.isspace():
                self._content(char)
                self._passthrough = True
                return
        self._raw.append(char)
        if self._state == _CALL_START:
            if char.isspace():
                return
            self._begin_call()
            self._state = _IN_CALL
            if char != "{":
                raise MalformedToolCall("a tool call is a JSON object")
            self._call_char(char)
        elif self._state == _IN_CALL and self._call_char(char):
            self._state = _AFTER_CALL

    def _finish(self) -> None:
        if self._state == _START:
            self._content(self._tag.flush())
        elif self._state in (_CALL_START, _IN_CALL):
            raise MalformedToolCall("the output ended inside a tool call")
