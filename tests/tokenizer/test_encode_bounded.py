"""Tokenizer.encode_bounded: the same ids as encode for a text that fits; a refusal naming the count for one that
does not, in time that follows the limit rather than the text (a 30 MB prompt is refused in well under a second)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from infero.checkpoint.gguf import GGUFFile
from infero.errors import PromptTooLongError
from infero.tokenizer import Tokenizer
from infero.tokenizer.tokenizer import PIECE_CHARS, TooManyTokensError, _pieces

FIXTURES = Path(__file__).parent.parent / "fixtures" / "tokenizer"
REFERENCE = json.loads((FIXTURES / "llamacpp_reference.json").read_text(encoding="utf-8"))
FILES = {v["name"]: v["file"] for v in REFERENCE["vocabs"] if (FIXTURES / v["file"]).is_file()}
PROSE = (
    "The quick brown fox jumps over the lazy dog, then naps; numbers 12345 and 2026-12-03 follow. "
    "Ünïcödé wörds, CJK 你好世界, emoji 🦊 and <|im_start|> text.\n\n"
)


def tokenizer(name: str) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(GGUFFile.open(FIXTURES / FILES[name]).metadata)


@pytest.fixture(scope="module", params=sorted(FILES))
def tok(request) -> Tokenizer:
    return tokenizer(request.param)


def test_a_text_that_fits_gets_the_ids_of_encode(tok):
    for text in REFERENCE["strings"]:
        for special in (True, False):
            ids = tok.encode(text, special)
            assert tok.encode_bounded(text, len(ids), special) == ids


def test_a_text_one_token_over_the_limit_is_refused_with_its_count(tok):
    for text in REFERENCE["strings"]:
        ids = tok.encode(text)
        if len(ids) < 2:
            continue  # a limit of 0 tokens refuses any text by its length, without counting
        limit = len(ids) - 1
        with pytest.raises(PromptTooLongError) as e:
            tok.encode_bounded(text, limit)
        by_length = tok.max_token_bytes is not None and len(text) > limit * tok.max_token_bytes
        assert e.value.limit == limit and e.value.exact is not by_length
        if by_length:  # a few long tokens: refused by its length, with a lower bound of its count
            assert limit < e.value.num_tokens <= len(ids)
            assert f"has at least {e.value.num_tokens} tokens, more than the {limit} allowed" in str(e.value)
        else:
            assert f"has {len(ids)} tokens, more than the {limit} allowed" in str(e.value)


def test_a_long_text_that_fits_is_counted_in_pieces_and_gets_the_ids_of_encode(tok):
    text = PROSE * (PIECE_CHARS // len(PROSE) + 1)
    ids = tok.encode(text)
    assert tok.encode_bounded(text, len(ids)) == ids
    with pytest.raises(TooManyTokensError) as e:
        tok.encode_bounded(text, len(ids) - 1)
    assert e.value.num_tokens == len(ids) and e.value.exact


def test_pieces_rejoin_to_the_text_and_are_cut_where_a_word_starts():
    text = PROSE * (5 * PIECE_CHARS // len(PROSE))
    pieces = list(_pieces(text))
    assert "".join(pieces) == text and len(pieces) > 4
    assert all(len(p) <= PIECE_CHARS for p in pieces)
    for before, piece in zip(pieces[:-1], pieces[1:], strict=True):
        assert piece[0] == " " and piece[1].isalpha() and not before[-1].isspace()
    spaceless = "x" * (2 * PIECE_CHARS + 5)
    assert [len(p) for p in _pieces(spaceless)] == [PIECE_CHARS, PIECE_CHARS, 5]


def test_pieces_of_prose_count_the_whole_texts_tokens_or_one_more_a_cut():
    # The cuts fall where the pre-tokenizers split, so BPE vocabularies count the whole text's tokens; SentencePiece
    # puts its space before each piece, one more token a cut (what CUT_SLACK allows for).
    text = PROSE * (3 * PIECE_CHARS // len(PROSE))
    pieces = list(_pieces(text))
    for name, extra in [("llama-bpe", 0), ("qwen2", 0), ("gpt-2", 0), ("smollm", 0), ("spm", len(pieces) - 1)]:
        tok = tokenizer(name)
        counted = sum(len(tok.encode(p, add_special_tokens=False)) for p in pieces)
        assert counted == len(tok.encode(text, add_special_tokens=False)) + extra, name


@pytest.mark.parametrize("by_length", [True, False])
def test_thirty_megabytes_are_refused_in_time_that_follows_the_limit(by_length):
    tok = tokenizer("llama-bpe")
    if not by_length:
        tok.max_token_bytes = None  # as for a vocabulary whose encoding can drop text: counted in pieces
    text = "hello world " * (30_000_000 // 12)
    start = time.perf_counter()
    with pytest.raises(TooManyTokensError) as e:
        tok.encode_bounded(text, 2048)
    assert time.perf_counter() - start < 1.0
    assert not e.value.exact and 2048 < e.value.num_tokens <= len(text)
    assert "at least" in str(e.value)


def test_the_length_bound_holds_for_every_vocabulary(tok):
    # max_token_bytes: no token stands for more bytes, so the refusal by length never refuses a text that fits.
    if tok.max_token_bytes is None:
        return
    for text in REFERENCE["strings"]:
        assert len(tok.encode(text, add_special_tokens=False)) * tok.max_token_bytes >= len(text.encode())
