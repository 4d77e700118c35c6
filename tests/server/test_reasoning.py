"""The `<think>` reasoning parser: canned outputs parsed whole, and streamed split at every position."""

import json
import random
from pathlib import Path

import pytest

from infero.errors import InferoError
from infero.server.reasoning import (
    ParsedReasoning,
    ReasoningDelta,
    choose_reasoning_parser,
    get_reasoning_parser,
)
from infero.tokenizer.chat_template import ChatTemplate

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "chat_templates"
THINK = get_reasoning_parser("think")

# text, starts_in_reasoning, reasoning_content, content
CASES = {
    "reasoning then answer": ("<think>\nLet me think.\nIt is 2 + 2.\n</think>\n\nThe answer is 4.", False,
                              "Let me think.\nIt is 2 + 2.", "The answer is 4."),
    "empty reasoning (Qwen3 without thinking)": ("<think>\n\n</think>\n\nHi!", False, None, "Hi!"),
    "no reasoning": ("Hi there,\n  friend. ", False, None, "Hi there,\n  friend. "),
    "tag mentioned later is content": ("Use <think> and </think> tags.", False, None,
                                       "Use <think> and </think> tags."),
    "leading whitespace before the tag": ("  \n<think>x</think>y", False, "x", "y"),
    "cut off while thinking": ("<think>\nstill thinking about it  ", False, "still thinking about it  ", None),
    "tag-like text inside reasoning": ("<think>a < b, </thin k>, <think> x</think>c", False,
                                       "a < b, </thin k>, <think> x", "c"),
    "second end tag is content": ("<think>a</think>b</think>c", False, "a", "b</think>c"),
    "non-ASCII": ("<think>Überlegung: 東京 → 🗼</think>\nÉté", False, "Überlegung: 東京 → 🗼", "Été"),
    "reasoning only": ("<think>just this</think>\n", False, "just this", None),
    "empty output": ("", False, None, None),
    "partial start tag only": ("<thi", False, None, "<thi"),
    "prompt opened the tag": ("Okay, the user asks.\n</think>\n\nAnswer.", True, "Okay, the user asks.", "Answer."),
    "prompt opened it and the model repeats it": ("<think>\nabc\n</think>xyz", True, "abc", "xyz"),
    "prompt opened it, cut off": ("\nthinking <thi", True, "thinking <thi", None),
    "prompt opened it, nothing generated": ("", True, None, None),
    "prompt opened it, empty reasoning": ("\n</think>\n\nDone", True, None, "Done"),
}  # fmt: skip


def splits(text: str):
    yield [text]
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]
    yield list(text)


def stream(pieces: list[str], starts_in_reasoning: bool) -> tuple[str | None, str | None]:
    streaming = THINK.streaming_parser(starts_in_reasoning)
    reasoning, content = [], []
    for delta in [*(streaming.feed(piece) for piece in pieces), streaming.finish()]:
        assert delta.reasoning_content != "" and delta.content != ""  # empty parts are None
        reasoning.append(delta.reasoning_content or "")
        content.append(delta.content or "")
    return "".join(reasoning) or None, "".join(content) or None


@pytest.mark.parametrize("case", CASES)
def test_parse_splits_reasoning_from_content(case):
    text, starts_in_reasoning, reasoning, content = CASES[case]
    assert THINK.parse(text, starts_in_reasoning) == ParsedReasoning(reasoning, content)


@pytest.mark.parametrize("case", CASES)
def test_stream_split_anywhere_equals_parse(case):
    text, starts_in_reasoning, reasoning, content = CASES[case]
    for pieces in splits(text):
        assert stream(pieces, starts_in_reasoning) == (reasoning, content), pieces


def test_stream_holds_back_only_whitespace_and_tag_prefixes():
    streaming = THINK.streaming_parser()
    assert streaming.feed(" \n<thi") == ReasoningDelta()  # may be the start tag
    assert streaming.feed("nk>\n") == ReasoningDelta()  # whitespace after the tag is dropped
    assert streaming.in_reasoning
    assert streaming.feed("Step 1") == ReasoningDelta("Step 1")
    assert streaming.feed(" <") == ReasoningDelta()  # may be the end tag (with the space before it)
    assert streaming.feed("b") == ReasoningDelta(" <b")
    assert streaming.feed("\n</think>\n\nAns") == ReasoningDelta(None, "Ans")
    assert not streaming.in_reasoning
    assert streaming.feed("wer </think> ") == ReasoningDelta(None, "wer </think> ")  # content passes at once
    assert streaming.finish() == ReasoningDelta()


def test_stream_without_reasoning_releases_content_at_the_first_other_character():
    streaming = THINK.streaming_parser()
    assert streaming.feed("\n") == ReasoningDelta()
    assert streaming.feed("H") == ReasoningDelta(None, "\nH")
    assert streaming.feed("i <think>") == ReasoningDelta(None, "i <think>")
    assert not streaming.in_reasoning


def test_delta_carries_both_parts_when_a_piece_crosses_the_end_tag():
    streaming = THINK.streaming_parser(starts_in_reasoning=True)
    assert streaming.in_reasoning
    delta = streaming.feed("abc</think>xyz")
    assert delta == ReasoningDelta("abc", "xyz")
    assert delta.to_openai() == {"reasoning_content": "abc", "content": "xyz"}
    assert ReasoningDelta().to_openai() == {} and not ReasoningDelta()


def test_parsed_reasoning_serializes_in_openai_shape():
    assert ParsedReasoning("r", "c").to_openai() == {"content": "c", "reasoning_content": "r"}
    assert ParsedReasoning(None, "c").to_openai() == {"content": "c"}


def qwen3_template() -> ChatTemplate:
    fixture = json.loads((FIXTURES / "qwen3.json").read_text())
    return ChatTemplate(fixture["source"], fixture["bos_token"], fixture["eos_token"])


def test_prompt_opens_reasoning_only_when_the_prompt_ends_inside_think():
    messages = [{"role": "user", "content": "Is <think> a tag?"}]
    template = qwen3_template()
    assert not THINK.prompt_opens_reasoning(template.render(messages))  # Qwen3 lets the model write <think>
    assert not THINK.prompt_opens_reasoning(template.render(messages, enable_thinking=False))  # closed: no thinking
    assert THINK.prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")  # DeepSeek-R1, Qwen3 Thinking-2507


def test_choose_reasoning_parser_from_templates():
    assert choose_reasoning_parser(qwen3_template().source) == "think"
    for name in ("qwen2.5", "llama-3.1", "chatml", "mistral", "smollm2"):
        assert choose_reasoning_parser(json.loads((FIXTURES / f"{name}.json").read_text())["source"]) is None
    assert choose_reasoning_parser(None) is None


def test_get_reasoning_parser_knows_vllm_names():
    assert get_reasoning_parser("qwen3").parse("<think>a</think>b") == ParsedReasoning("a", "b")
    deepseek = get_reasoning_parser("deepseek_r1")
    assert deepseek.parse("a</think>b", starts_in_reasoning=True) == ParsedReasoning("a", "b")
    with pytest.raises(InferoError, match="deepseek_r1, qwen3, think"):
        get_reasoning_parser("granite")


def test_random_texts_stream_like_parse():
    rng = random.Random(0)
    fragments = ["<think>", "</think>", "<thi", "</th", "<", "/", ">", " ", "\n", "a", "é", "think", "</think", "x y"]
    for _ in range(3000):
        text = "".join(rng.choice(fragments) for _ in range(rng.randint(0, 10)))
        starts_in_reasoning = rng.random() < 0.5
        cuts = sorted(rng.sample(range(1, len(text)), min(3, len(text) - 1))) if len(text) > 1 else []
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        parsed = THINK.parse(text, starts_in_reasoning)
        assert stream(pieces, starts_in_reasoning) == (parsed.reasoning_content, parsed.content), pieces
