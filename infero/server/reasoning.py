"""Reasoning parsers: split a thinking model's output into `reasoning_content` and `content`.

Qwen3, QwQ and DeepSeek-R1 write their reasoning between `<think>` and `</think>`, then the answer:

    <think>
    The user wants ...
    </think>

    The answer is 4.

Some templates open the `<think>` in the prompt (DeepSeek-R1's newer ones, Qwen3 "Thinking" models), so the output
starts inside the reasoning without the tag: pass `starts_in_reasoning` (`prompt_opens_reasoning(prompt)` tells).
Otherwise an output that does not start with `<think>` has no reasoning; `<think>` later in the text is content.

As in vLLM's deepseek_r1 / qwen3 parsers, except: whitespace next to the tags (the newlines models write around
them) belongs to neither part; an output cut off before `</think>` is all reasoning; and `<think>` counts only at
the start of the output. Empty parts are None. The streaming parser, fed the same text in any pieces, produces the
same parts: it holds back only whitespace and what may be the start of a tag.
"""

from dataclasses import dataclass
from typing import Any

from infero.errors import InferoError
from infero.server.tool_parsers.base import TagScanner


@dataclass
class ParsedReasoning:
    reasoning_content: str | None
    content: str | None

    def to_openai(self) -> dict[str, Any]:
        """The message's "content" and, when there is reasoning, "reasoning_content"."""
        message: dict[str, Any] = {"content": self.content}
        if self.reasoning_content is not None:
            message["reasoning_content"] = self.reasoning_content
        return message


@dataclass
class ReasoningDelta:
    """What a stream produced from some text: more reasoning, more content, or both (reasoning first)."""

    reasoning_content: str | None = None
    content: str | None = None

    def __bool__(self) -> bool:
        return self.reasoning_content is not None or self.content is not None

    def to_openai(self) -> dict[str, Any]:
        """The chunk's "delta" fields."""
        delta: dict[str, Any] = {}
        if self.reasoning_content is not None:
            delta["reasoning_content"] = self.reasoning_content
        if self.content is not None:
            delta["content"] = self.content
        return delta


class ThinkReasoningParser:
    """`<think>...</think>` reasoning. Stateless: one instance serves every request."""

    name = "think"
    start_tag = "<think>"
    end_tag = "</think>"

    def parse(self, text: str, starts_in_reasoning: bool = False) -> ParsedReasoning:
        """Split a finished output into reasoning and content."""
        stripped = text.lstrip()
        if stripped.startswith(self.start_tag):
            rest = stripped[len(self.start_tag) :]
        elif starts_in_reasoning:
            rest = text
        else:
            return ParsedReasoning(None, text or None)
        rest = rest.lstrip()
        end = rest.find(self.end_tag)
        if end < 0:
            return ParsedReasoning(rest or None, None)
        return ParsedReasoning(rest[:end].rstrip() or None, rest[end + len(self.end_tag) :].lstrip() or None)

    def streaming_parser(self, starts_in_reasoning: bool = False) -> "StreamingReasoningParser":
        """A new parser for one streamed choice."""
        return StreamingReasoningParser(self.start_tag, self.end_tag, starts_in_reasoning)

    def prompt_opens_reasoning(self, prompt: str) -> bool:
        """Whether the rendered prompt ends inside an opened `<think>`, so the output starts in the reasoning."""
        return prompt.rstrip().endswith(self.start_tag)


# Where the stream is.
_START, _REASONING_START, _REASONING, _CONTENT_START, _CONTENT = range(5)


class StreamingReasoningParser:
    """Splits one choice's text deltas into reasoning and content. `feed` each delta, then `finish` once."""

    def __init__(self, start_tag: str, end_tag: str, starts_in_reasoning: bool = False) -> None:
        self._starts_in_reasoning = starts_in_reasoning
        self._start = TagScanner(start_tag)
        self._end = TagScanner(end_tag)
        self._state = _START
        self._reasoning: list[str] = []
        self._content: list[str] = []

    @property
    def in_reasoning(self) -> bool:
        """Whether the text read so far ends inside the reasoning (or may: the start is still undecided)."""
        return self._state in (_REASONING_START, _REASONING) or (self._state == _START and self._starts_in_reasoning)

    def feed(self, delta_text: str) -> ReasoningDelta:
        """Read the next piece of generated text; return the reasoning and content it completes."""
        for i, char in enumerate(delta_text):
            if self._state == _CONTENT:
                self._content.append(delta_text[i:])
                break
            self._step(char)
        return self._take()

    def finish(self) -> ReasoningDelta:
        """The output ended: release everything held."""
        if self._state == _START:
            self._leave_start(self._start.flush())
        if self._state == _REASONING:
            self._reasoning.append(self._end.flush())
        return self._take()

    def _step(self, char: str) -> None:
        state = self._state
        if state == _START:
            released, matched = self._start.feed(char)
            if matched is not None:
                self._state = _REASONING_START
            elif released:
                self._leave_start(released + self._start.flush())
        elif state == _REASONING_START or state == _REASONING:
            if state == _REASONING_START:
                if char.isspace():
                    return
                self._state = _REASONING
            released, matched = self._end.feed(char)
            self._reasoning.append(released)
            if matched is not None:
                self._state = _CONTENT_START
        elif state == _CONTENT_START:
            if not char.isspace():
                self._state = _CONTENT
                self._content.append(char)
        else:
            self._content.append(char)

    def _leave_start(self, text: str) -> None:
        """The output does not start with the start tag: `text` (all read so far) is reasoning or content."""
        if self._starts_in_reasoning:
            self._state = _REASONING_START
            for char in text:
                self._step(char)
        else:
            self._state = _CONTENT
            self._content.append(text)

    def _take(self) -> ReasoningDelta:
        reasoning, content = "".join(self._reasoning), "".join(self._content)
        self._reasoning.clear()
        self._content.clear()
        return ReasoningDelta(reasoning or None, content or None)


REASONING_PARSERS: dict[str, type[ThinkReasoningParser]] = {
    "think": ThinkReasoningParser,
    "qwen3": ThinkReasoningParser,  # vLLM's names for the same format
    "deepseek_r1": ThinkReasoningParser,
}


def get_reasoning_parser(name: str) -> ThinkReasoningParser:
    """The parser called `name`; raise InferoError naming the known ones otherwise."""
    if name not in REASONING_PARSERS:
        known = ", ".join(sorted(REASONING_PARSERS))
        raise InferoError(f"unknown reasoning parser {name!r}; choose one of: {known}")
    return REASONING_PARSERS[name]()


def choose_reasoning_parser(chat_template: str | None) -> str | None:
    """The parser for a chat template whose model thinks in `<think>` tags, else None."""
    if chat_template and ThinkReasoningParser.start_tag in chat_template:
        return ThinkReasoningParser.name
    return None
