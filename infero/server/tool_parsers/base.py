"""What every tool-call parser shares: the result types, the call-object reader, and the streaming machinery.

A model asks for a tool by writing a JSON object `{"name": ..., "arguments": {...}}` in its text, wrapped in a
format of its family (see hermes.py, llama3_json.py). A parser turns the finished text into content plus tool calls
(`ToolParser.parse`), or does the same on the fly from text deltas (`StreamingToolParser`), in the shape OpenAI
streams tool calls: a first delta with the call's id, type and name, then fragments of its `arguments` string.

The two must agree: concatenating the streamed fragments gives exactly the non-streaming arguments, which are
`json.dumps(arguments, ensure_ascii=False)`. Streaming gets there by re-serializing the model's JSON one character at
a time as `json.dumps` would (`JsonWriter`), so arguments stream as they are generated rather than at the end.

Rules both paths follow, so they agree:
- JSON is read as `json.loads(strict=False)` reads it (control characters allowed inside strings), except that
  NaN/Infinity and repeated keys in one object make the call malformed.
- A call object has a non-empty string "name" and optionally "arguments" (or "parameters", not both; missing means
  `{}`); other keys are ignored unless the parser names the keys it allows.
- Whitespace next to a tool call is not content: text before a call loses its trailing whitespace, text after one
  its leading whitespace; content that ends up empty is None.
- Malformed output is never an error. `parse` returns the whole text as content with no calls. A stream emits the
  text it held for the broken call as content and passes the rest through; a stream cannot take back deltas already
  sent, so the two agree exactly only when the break comes before the call's name was streamed.
"""

import json
import re
import secrets
import string
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

ARGUMENT_KEYS = ("arguments", "parameters")
_ID_ALPHABET = string.ascii_letters + string.digits


def make_tool_call_id() -> str:
    """A tool call id as OpenAI makes them: "call_" and 24 random letters and digits."""
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


# --- results -------------------------------------------------------------------------------------------------------


@dataclass
class ToolCall:
    """One complete call: `arguments` is a JSON text, as OpenAI sends it."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParsedToolCalls:
    """A finished output split into its content (None when there is none) and its tool calls."""

    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)

    def to_openai(self) -> dict[str, Any]:
        """The message's "content" and, when there are calls, "tool_calls"."""
        message: dict[str, Any] = {"content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [call.to_openai() for call in self.tool_calls]
        return message


@dataclass
class DeltaToolCall:
    """A piece of a streamed call. The first piece of a call has `id` and `name` (and `arguments`, maybe ""); the
    later ones have only `arguments`, the next fragment of the JSON text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str | None = None

    def to_openai(self) -> dict[str, Any]:
        delta: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            delta["id"] = self.id
            delta["type"] = "function"
        function = {}
        if self.name is not None:
            function["name"] = self.name
        if self.arguments is not None:
            function["arguments"] = self.arguments
        delta["function"] = function
        return delta


@dataclass
class DeltaMessage:
    """What a stream produced from some text: content, or pieces of tool calls."""

    content: str | None = None
    tool_calls: list[DeltaToolCall] = field(default_factory=list)

    def to_openai(self) -> dict[str, Any]:
        """The chunk's "delta" object."""
        delta: dict[str, Any] = {}
        if self.content is not None:
            delta["content"] = self.content
        if self.tool_calls:
            delta["tool_calls"] = [call.to_openai() for call in self.tool_calls]
        return delta


# --- the parsers' interface ----------------------------------------------------------------------------------------


class ToolParser(ABC):
    """Finds tool calls in a model's output. Stateless: one instance serves every request."""

    name: str

    @abstractmethod
    def parse(self, text: str) -> ParsedToolCalls:
        """Split a finished output into content and tool calls; malformed calls leave the whole text as content."""

    @abstractmethod
    def streaming_parser(self) -> "StreamingToolParser":
        """A new parser for one streamed choice."""

    def for_tools(self, tools: list[dict] | None) -> "ToolParser":
        """The parser for a request offering `tools` (a format that reads arguments by their schemas needs them)."""
        return self


class MalformedToolCall(ValueError):
    """The text of a tool call is not a call; parsers catch it and keep the text as content."""


class StreamingToolParser(ABC):
    """Turns one choice's text deltas into content and tool-call deltas. `feed` each delta, then `finish` once.

    Subclasses read the format around the calls a character at a time in `_step`, and hand each call's JSON to
    `_begin_call` / `_call_char`; this class streams the call and recovers from malformed ones."""

    def __init__(self, allowed_keys: frozenset[str] | None = None) -> None:
        self._allowed_keys = allowed_keys
        self._out = _DeltaBuilder()
        self._raw: list[str] = []  # the text of the call being read, kept to become content if it is malformed
        self._reader: _CallReader | None = None
        self._header_sent = False
        self._passthrough = False  # after a malformed call, everything is content
        self._skip_space = False  # whitespace right after a call is not content
        self.num_tool_calls = 0  # calls whose first delta went out; the next call's index

    def feed(self, delta_text: str) -> list[DeltaMessage]:
        """Read the next piece of generated text; return the deltas it completes (possibly none)."""
        self._out = out = _DeltaBuilder()
        for i, char in enumerate(delta_text):
            if self._passthrough:
                out.content(delta_text[i:])
                break
            try:
                self._step(char)
            except MalformedToolCall:
                self._fail()
        return out.build()

    def finish(self) -> list[DeltaMessage]:
        """The output ended: release all held text, and emit an unfinished call's text as content."""
        self._out = _DeltaBuilder()
        if not self._passthrough:
            try:
                self._finish()
            except MalformedToolCall:
                self._fail()
        return self._out.build()

    @abstractmethod
    def _step(self, char: str) -> None:
        """Read one character; raise MalformedToolCall when the text cannot be the format's calls."""

    @abstractmethod
    def _finish(self) -> None:
        """The text ended: release held content; raise MalformedToolCall if a call is unfinished."""

    # helpers for subclasses

    def _content(self, text: str) -> None:
        if text:
            self._out.content(text)

    def _text_char(self, char: str, start: "TagScanner") -> bool:
        """A character of the content between calls (whitespace right after a call dropped); True when it completes
        the `start` tag, which then begins the call's raw text."""
        if self._skip_space:
            if char.isspace():
                return False
            self._skip_space = False
        released, matched = start.feed(char)
        self._content(released)
        if matched is None:
            return False
        self._raw = [matched]
        return True

    def _begin_call(self) -> None:
        self._reader = _CallReader(self._allowed_keys)
        self._header_sent = False

    def _call_char(self, char: str) -> bool:
        """Feed a character of the call's JSON (the first is "{"); stream what it completes. True when the call
        object is complete."""
        reader = self._reader
        reader.feed(char)
        if not self._header_sent and reader.name is not None:
            self._out.tool_header(self.num_tool_calls, make_tool_call_id(), reader.name, reader.take_arguments())
            self._header_sent = True
            self.num_tool_calls += 1
        elif self._header_sent and reader.fresh_arguments:
            self._out.tool_arguments(self.num_tool_calls - 1, reader.take_arguments())
        if not reader.done:
            return False
        self._reader = None
        self._raw = []
        return True

    def _fail(self) -> None:
        self._content("".join(self._raw))
        self._raw = []
        self._reader = None
        self._passthrough = True


class _DeltaBuilder:
    """Collects one feed's output, merging neighbours: content with content, a call's fragments with its header."""

    def __init__(self) -> None:
        self._items: list[list] = []  # [index or None for content, id, name, parts]

    def content(self, text: str) -> None:
        if self._items and self._items[-1][0] is None:
            self._items[-1][3].append(text)
        else:
            self._items.append([None, None, None, [text]])

    def tool_header(self, index: int, call_id: str, name: str, arguments: str) -> None:
        self._items.append([index, call_id, name, [arguments]])

    def tool_arguments(self, index: int, arguments: str) -> None:
        if self._items and self._items[-1][0] == index:
            self._items[-1][3].append(arguments)
        else:
            self._items.append([index, None, None, [arguments]])

    def build(self) -> list[DeltaMessage]:
        messages = []
        for index, call_id, name, parts in self._items:
            text = "".join(parts)
            if index is None:
                messages.append(DeltaMessage(content=text))
            else:
                messages.append(DeltaMessage(tool_calls=[DeltaToolCall(index, call_id, name, text)]))
        return messages


class TagScanner:
    """Finds a tag in text read a character at a time. It holds back what might be the start of the tag and the
    whitespace just before it, since whitespace next to a tag is dropped; everything else is released at once."""

    def __init__(self, tag: str) -> None:
        # Matching restarts only at the mismatching character, which is right when the tag's first character does
        # not occur again in it (true of every tag here).
        assert len(tag) > 1 and tag[0] not in tag[1:], tag
        self.tag = tag
        self.space = ""
        self.partial = ""

    def feed(self, char: str) -> tuple[str, str | None]:
        """Return the text released by `char`, and the held text (whitespace + tag) when the tag just completed."""
        if self.partial:
            if self.tag.startswith(self.partial + char):
                self.partial += char
                if self.partial != self.tag:
                    return "", None
                matched = self.space + self.partial
                self.space = self.partial = ""
                return "", matched
            released = self.space + self.partial
            self.space = self.partial = ""
            more, matched = self.feed(char)
            return released + more, matched
        if char.isspace():
            self.space += char
            return "", None
        if char == self.tag[0]:
            self.partial = char
            return "", None
        released = self.space + char
        self.space = ""
        return released, None

    def flush(self) -> str:
        """Release whatever is held."""
        held = self.space + self.partial
        self.space = self.partial = ""
        return held


# --- reading a call object ------------------------------------------------------------------------------------------


def _object_without_repeated_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        raise MalformedToolCall("a key is repeated in one object")
    return obj


def _reject_constant(name: str) -> Any:
    raise MalformedToolCall(f"{name} is not JSON")


_DECODER = json.JSONDecoder(
    strict=False, object_pairs_hook=_object_without_repeated_keys, parse_constant=_reject_constant
)


def skip_space(text: str, pos: int) -> int:
    """The first position at or after `pos` that is not whitespace."""
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def read_call(text: str, pos: int, allowed_keys: frozenset[str] | None = None) -> tuple[ToolCall, int]:
    """Read the call object that starts at text[pos] ("{"); return it and the position after it.
    Raise MalformedToolCall if it is not valid JSON or not a call."""
    if not text.startswith("{", pos):
        raise MalformedToolCall("a tool call is a JSON object")
    try:
        obj, end = _DECODER.raw_decode(text, pos)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, and int() refusing a number of 4300+ digits
        raise MalformedToolCall(str(e)) from e
    if allowed_keys is not None and not set(obj) <= allowed_keys:
        raise MalformedToolCall(f"unexpected keys in a tool call: {sorted(set(obj) - allowed_keys)}")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        raise MalformedToolCall("a tool call needs a name")
    present = [key for key in ARGUMENT_KEYS if key in obj]
    if len(present) > 1:
        raise MalformedToolCall('a tool call has both "arguments" and "parameters"')
    arguments = obj[present[0]] if present else {}
    return ToolCall(make_tool_call_id(), name, json.dumps(arguments, ensure_ascii=False)), end


# --- JSON re-serialized incrementally --------------------------------------------------------------------------------

# What the writer expects next.
_VALUE, _VALUE_OR_CLOSE, _KEY, _KEY_OR_CLOSE, _COLON, _COMMA_OR_CLOSE, _DONE = range(7)

_JSON_SPACE = frozenset(" \t\n\r")
_NUMBER_CHARS = frozenset("0123456789+-.eE")
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?")
_LETTERS = frozenset(string.ascii_letters)
_LITERALS = ("true", "false", "null")
_HEX_DIGITS = frozenset(string.hexdigits)
_SIMPLE_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
# How json.dumps(ensure_ascii=False) writes a character inside a string; characters not listed are written as is.
_ESCAPED = {chr(i): f"\\u{i:04x}" for i in range(0x20)}
_ESCAPED.update({'"': '\\"', "\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t", "\b": "\\b", "\f": "\\f"})


class JsonWriter:
    """Reads one JSON value a character at a time and writes it out, as far as it has read, exactly as
    `json.dumps(json.loads(text, strict=False), ensure_ascii=False)` would: ", " and ": " separators, strings
    re-escaped, numbers re-formatted (a number is written when the character after it arrives). Raises
    MalformedToolCall at the first character that cannot continue valid JSON (also for NaN, Infinity and a repeated
    key). Subclasses receive the output through `_emit` and hooks."""

    def __init__(self) -> None:
        self._stack: list[set[str] | None] = []  # per open container: the keys seen (object) or None (array)
        self._expect = _VALUE
        self._token: str | None = None  # "key", "string", "number" or "literal" while one is being read
        self._chars: list[str] = []  # the number or literal so far, or the decoded key
        self._escape: str | None = None  # inside a string: "" after a backslash, "uXXX" while reading \uXXXX
        self._high: int | None = None  # a \u escape of a high surrogate, waiting to see if a low one follows
        self.done = False

    def feed(self, char: str) -> None:
        token = self._token
        if token == "string" or token == "key":
            self._string_char(char)
            return
        if token == "number":
            if char in _NUMBER_CHARS:
                self._chars.append(char)
                return
            self._end_number()
        elif token == "literal":
            if char in _LETTERS:
                self._chars.append(char)
                text = "".join(self._chars)
                if not any(literal.startswith(text) for literal in _LITERALS):
                    raise MalformedToolCall(f"{text!r} is not JSON")
                return
            self._end_literal()
        self._structural(char)

    def finish(self) -> None:
        """The text ended: complete a number or literal at the top level; raise if the value is unfinished."""
        if self._token == "number":
            self._end_number()
        elif self._token == "literal":
            self._end_literal()
        if not self.done:
            raise MalformedToolCall("the JSON text is unfinished")

    # hooks

    def _emit(self, text: str) -> None:
        """Output: the next piece of the re-serialized value."""

    def _on_key(self, key: str, depth: int) -> None:
        """A key was read in an object `depth` containers deep (1: the top-level object)."""

    def _on_colon(self, depth: int) -> None:
        """The value of the key just read starts next."""

    def _on_value_end(self, depth: int) -> None:
        """A value ended inside a container `depth` deep (0: the whole value ended)."""

    # the grammar

    def _structural(self, char: str) -> None:
        if char in _JSON_SPACE:
            return
        expect = self._expect
        if expect == _VALUE or expect == _VALUE_OR_CLOSE:
            if char == "]" and expect == _VALUE_OR_CLOSE:
                self._close()
            else:
                self._start_value(char)
        elif expect == _KEY or expect == _KEY_OR_CLOSE:
            if char == '"':
                self._token, self._chars = "key", []
            elif char == "}" and expect == _KEY_OR_CLOSE:
                self._close()
            else:
                raise MalformedToolCall(f"expected a key, got {char!r}")
        elif expect == _COLON:
            if char != ":":
                raise MalformedToolCall(f"expected ':', got {char!r}")
            self._emit(": ")
            self._expect = _VALUE
            self._on_colon(len(self._stack))
        elif expect == _COMMA_OR_CLOSE:
            in_object = self._stack[-1] is not None
            if char == ",":
                self._emit(", ")
                self._expect = _KEY if in_object else _VALUE
            elif char == ("}" if in_object else "]"):
                self._close()
            else:
                raise MalformedToolCall(f"expected ',' or a closing bracket, got {char!r}")
        else:
            raise MalformedToolCall(f"extra text after the JSON value: {char!r}")

    def _start_value(self, char: str) -> None:
        if char == "{":
            self._stack.append(set())
            self._emit("{")
            self._expect = _KEY_OR_CLOSE
        elif char == "[":
            self._stack.append(None)
            self._emit("[")
            self._expect = _VALUE_OR_CLOSE
        elif char == '"':
            self._token = "string"
            self._emit('"')
        elif char == "-" or "0" <= char <= "9":
            self._token, self._chars = "number", [char]
        elif char in "tfn":
            self._token, self._chars = "literal", [char]
        else:
            raise MalformedToolCall(f"expected a JSON value, got {char!r}")

    def _close(self) -> None:
        self._emit("}" if self._stack.pop() is not None else "]")
        self._end_value()

    def _end_value(self) -> None:
        self._token = None
        if self._stack:
            self._expect = _COMMA_OR_CLOSE
        else:
            self._expect = _DONE
            self.done = True
        self._on_value_end(len(self._stack))

    def _end_number(self) -> None:
        text = "".join(self._chars)
        if not _NUMBER.fullmatch(text):
            raise MalformedToolCall(f"{text!r} is not a JSON number")
        try:
            value = json.loads(text)
        except ValueError as e:  # an integer of more digits than int() converts
            raise MalformedToolCall(str(e)) from e
        self._emit(json.dumps(value))
        self._end_value()

    def _end_literal(self) -> None:
        text = "".join(self._chars)
        if text not in _LITERALS:
            raise MalformedToolCall(f"{text!r} is not JSON")
        self._emit(text)
        self._end_value()

    def _string_char(self, char: str) -> None:
        escape = self._escape
        if escape is None:
            if char == "\\":
                self._escape = ""
                return
            self._flush_high()
            if char == '"':
                self._end_string()
            else:
                self._put(char)
        elif escape == "":
            if char == "u":
                self._escape = "u"
            elif char in _SIMPLE_ESCAPES:
                self._escape = None
                self._flush_high()
                self._put(_SIMPLE_ESCAPES[char])
            else:
                raise MalformedToolCall(f"invalid escape \\{char}")
        else:
            if char not in _HEX_DIGITS:
                raise MalformedToolCall("invalid \\uXXXX escape")
            escape += char
            if len(escape) < 5:
                self._escape = escape
                return
            self._escape = None
            self._unicode_escape(int(escape[1:], 16))

    def _unicode_escape(self, code: int) -> None:
        # As json's scanner does: a high surrogate followed at once by a low one is one character; alone, each is
        # a character of its own.
        if self._high is not None:
            high, self._high = self._high, None
            if 0xDC00 <= code <= 0xDFFF:
                self._put(chr(0x10000 + ((high - 0xD800) << 10) + (code - 0xDC00)))
                return
            self._put(chr(high))
        if 0xD800 <= code <= 0xDBFF:
            self._high = code
        else:
            self._put(chr(code))

    def _flush_high(self) -> None:
        if self._high is not None:
            self._put(chr(self._high))
            self._high = None

    def _put(self, char: str) -> None:
        if self._token == "key":
            self._chars.append(char)
        else:
            self._emit(_ESCAPED.get(char, char))

    def _end_string(self) -> None:
        if self._token == "string":
            self._emit('"')
            self._end_value()
            return
        key = "".join(self._chars)
        keys = self._stack[-1]
        if key in keys:
            raise MalformedToolCall(f"key {key!r} is repeated")
        keys.add(key)
        self._token = None
        self._expect = _COLON
        self._emit(json.dumps(key, ensure_ascii=False))
        self._on_key(key, len(self._stack))


class _CallReader(JsonWriter):
    """Reads a call object; collects its name and streams the re-serialized text of its arguments."""

    def __init__(self, allowed_keys: frozenset[str] | None) -> None:
        super().__init__()
        self._allowed_keys = allowed_keys
        self.name: str | None = None
        self.fresh_arguments: list[str] = []  # argument text not yet taken
        self._arguments_key: str | None = None
        self._last_key: str | None = None
        self._value_key: str | None = None  # the top-level key whose value is being read
        self._name_text: list[str] = []

    def take_arguments(self) -> str:
        text = "".join(self.fresh_arguments)
        self.fresh_arguments.clear()
        return text

    def _emit(self, text: str) -> None:
        key = self._value_key
        if key is None:
            return
        if key == "name":
            self._name_text.append(text)
        elif key == self._arguments_key:
            self.fresh_arguments.append(text)

    def _on_key(self, key: str, depth: int) -> None:
        if depth != 1:
            return
        if self._allowed_keys is not None and key not in self._allowed_keys:
            raise MalformedToolCall(f"unexpected key in a tool call: {key!r}")
        if key in ARGUMENT_KEYS:
            if self._arguments_key is not None:
                raise MalformedToolCall('a tool call has both "arguments" and "parameters"')
            self._arguments_key = key
        self._last_key = key

    def _on_colon(self, depth: int) -> None:
        if depth == 1:
            self._value_key = self._last_key

    def _on_value_end(self, depth: int) -> None:
        if depth == 1:
            if self._value_key == "name":
                name = json.loads("".join(self._name_text))
                if not isinstance(name, str) or not name:
                    raise MalformedToolCall("a tool call's name must be a non-empty string")
                self.name = name
            self._value_key = None
        elif depth == 0:
            if self.name is None:
                raise MalformedToolCall("a tool call needs a name")
            if self._arguments_key is None:
                self.fresh_arguments.append("{}")
