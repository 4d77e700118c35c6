"""The tokenizer infero uses: a `tokenizers.Tokenizer` plus the facts the engine needs (BOS/EOS, end of generation).

Built from GGUF metadata (matching llama.cpp token for token) or from a Hugging Face directory.
Decoding goes through a per-token byte table where we know the decoder (byte-level BPE, SentencePiece),
so that decoding is plain byte concatenation: the same bytes llama.cpp renders, and trivially streamable.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from infero.errors import ModelFileError, PromptTooLongError
from infero.tokenizer import gguf_vocab

# encode_bounded counts a long text this many characters at a time, so that its memory follows the limit.
PIECE_CHARS = 1 << 16
# Tokens a cut between two pieces may add to their count (a cut inside a word splits one token in two or three);
# the count must pass the limit by this much per cut before the text is refused without a whole encode.
CUT_SLACK = 4


class TooManyTokensError(PromptTooLongError):
    """A text has more tokens than a limit: `num_tokens` of them (at least that many when not `exact`)."""

    def __init__(self, num_tokens: int, exact: bool, limit: int) -> None:
        self.num_tokens, self.exact, self.limit = num_tokens, exact, limit
        count = num_tokens if exact else f"at least {num_tokens}"
        super().__init__(f"the text has {count} tokens, more than the {limit} allowed")


class Tokenizer:
    """Text <-> token ids for one model. Build it with `from_gguf_metadata` or `from_hf_dir`."""

    def __init__(
        self,
        hf: HFTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_id: int | None,
        unk_token_id: int | None = None,
        pad_token_id: int | None = None,
        add_bos: bool,
        add_eos: bool,
        eog_token_ids: Iterable[int],
        special_token_ids: Iterable[int],
        chat_template: str | None,
        pieces: list[bytes] | None = None,
        strip_leading_space: bool = False,
        rstrip_tokens: Iterable[str] = (),
        vocab_size: int | None = None,
        special_splitter: gguf_vocab.SpecialTokenSplitter | None = None,
    ) -> None:
        self._hf = hf
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.unk_token_id = unk_token_id
        self.pad_token_id = pad_token_id
        self.add_bos = add_bos
        self.add_eos = add_eos
        self.eog_token_ids = frozenset(eog_token_ids)
        # Ids that decode(skip_special_tokens=True) leaves out: control and unknown tokens.
        self.special_token_ids = frozenset(special_token_ids)
        self.chat_template = chat_template
        # pieces[i] is the bytes token i renders to; None means "ask the HF decoder".
        self.pieces = pieces
        # SentencePiece: the space the encoder put before the text is not part of the text.
        self.strip_leading_space = strip_leading_space
        # Ids at or past vocab_size are phantom tokens of the HF model (see gguf_vocab._build_bpe): never emitted.
        hf_size = hf.get_vocab_size(with_added_tokens=True)
        self.vocab_size = hf_size if vocab_size is None else vocab_size
        self._has_phantoms = hf_size > self.vocab_size
        # Special tokens that swallow the ASCII whitespace after them (llama.cpp's RSTRIP attribute).
        self._rstrip = gguf_vocab.rstrip_pattern(list(rstrip_tokens))
        # When set, special tokens are cut out of the text by this instead of by `tokenizers` (see its docs).
        self._splitter = special_splitter
        # Every token stands for at most this many bytes of the text, so a text of more than limit x this many bytes
        # has more than `limit` tokens. None where encoding can drop text (whitespace swallowed after RSTRIP
        # tokens, phantom ids) or the bytes of tokens are unknown.
        lossless = pieces is not None and self._rstrip is None and not self._has_phantoms
        self.max_token_bytes = max(map(len, pieces), default=1) if lossless else None

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any], *, exact_special_split: bool | None = None) -> Tokenizer:
        """Build from a GGUF file's metadata (key -> value), reproducing llama.cpp's tokenization.

        `exact_special_split` forces (True) or avoids (False) llama.cpp's own special-token splitting instead of
        the faster one in `tokenizers`; by default it is used only where the two can differ.
        """
        vocab = gguf_vocab.read_gguf_vocab(metadata)
        splitter = gguf_vocab.special_splitter(vocab)
        if exact_special_split is True and splitter is None:
            ids = sorted(vocab.control_ids | vocab.user_defined_ids)
            splitter = gguf_vocab.SpecialTokenSplitter([(vocab.tokens[i], i) for i in ids], vocab.rstrip_ids)
        elif exact_special_split is False:
            splitter = None
        return cls(
            gguf_vocab.build_hf_tokenizer(vocab),
            bos_token_id=vocab.bos_id,
            eos_token_id=vocab.eos_id,
            unk_token_id=vocab.unk_id,
            pad_token_id=vocab.pad_id,
            add_bos=vocab.add_bos,
            add_eos=vocab.add_eos,
            eog_token_ids=vocab.eog_ids,
            special_token_ids=vocab.control_ids,
            chat_template=vocab.chat_template,
            pieces=gguf_vocab.piece_bytes(vocab),
            strip_leading_space=vocab.model == "llama" and vocab.add_space_prefix,
            rstrip_tokens=[vocab.tokens[i] for i in vocab.rstrip_ids],
            vocab_size=len(vocab.tokens),
            special_splitter=splitter,
        )

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """Build from a Hugging Face model directory: tokenizer.json plus tokenizer_config.json."""
        return _load_hf_dir(cls, Path(path))

    # -- encoding -------------------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special-token text in it becomes the special token. Adds BOS/EOS if the model does."""
        if self._splitter is not None:
            ids = []
            for fragment in self._splitter.split(text):
                if isinstance(fragment, int):
                    ids.append(fragment)
                else:
                    ids.extend(self._hf.encode(fragment, add_special_tokens=False).ids)
        else:
            if self._rstrip is not None:
                text = self._rstrip.sub(r"\1", text)
            ids = self._hf.encode(text, add_special_tokens=False).ids
        if self._has_phantoms:
            ids = [i for i in ids if i < self.vocab_size]
        if add_special_tokens:
            if self.add_bos and self.bos_token_id is not None:
                ids.insert(0, self.bos_token_id)
            if self.add_eos and self.eos_token_id is not None:
                ids.append(self.eos_token_id)
        return ids

    def encode_bounded(self, text: str, limit: int, add_special_tokens: bool = True) -> list[int]:
        """`encode(text)`, or TooManyTokensError once the text is known to have more than `limit` tokens: time and
        memory follow `limit`, not the text's length (a long text is counted piece by piece and refused as soon as
        the count passes the limit; the whole text is encoded only when it fits)."""
        num_special = self._num_special(add_special_tokens)
        if self.max_token_bytes is not None and len(text) > limit * self.max_token_bytes:
            # len(text) <= its UTF-8 bytes, and the tokens' bytes add up to at least the text's
            raise TooManyTokensError(-(-len(text) // self.max_token_bytes), False, limit)
        if len(text) > PIECE_CHARS:
            counted = num_special
            for cuts, piece in enumerate(_pieces(text)):
                counted += len(self.encode(piece, add_special_tokens=False))
                if counted > limit + CUT_SLACK * cuts:
                    raise TooManyTokensError(max(limit + 1, counted - CUT_SLACK * cuts), False, limit)
        ids = self.encode(text, add_special_tokens)
        if len(ids) > limit:
            raise TooManyTokensError(len(ids), True, limit)
        return ids

    def _num_special(self, add_special_tokens: bool) -> int:
        if not add_special_tokens:
            return 0
        bos = self.add_bos and self.bos_token_id is not None
        return bos + (self.add_eos and self.eos_token_id is not None)

    # -- decoding -------------------------------------------------------------------------------------------

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """The text of `ids`. Invalid UTF-8 (e.g. half a character) becomes U+FFFD."""
        ids = [int(i) for i in ids]
        if self.pieces is None:
            return self._hf.decode(ids, skip_special_tokens=skip_special_tokens)
        try:
            if skip_special_tokens:
                skip = self.special_token_ids
                data = b"".join([self.pieces[i] for i in ids if i not in skip])
            else:
                data = b"".join([self.pieces[i] for i in ids])
        except IndexError:
            bad = next(i for i in ids if not 0 <= i < len(self.pieces))
            raise ValueError(f"token id {bad} is outside the vocabulary (size {len(self.pieces)})") from None
        text = data.decode("utf-8", "replace")
        if self.strip_leading_space and text.startswith(" "):
            text = text[1:]
        return text

    # -- vocabulary -----------------------------------------------------------------------------------------

    def token_to_id(self, token: str) -> int | None:
        """The id of a token given by its vocabulary text (e.g. "<|im_end|>", "Ġthe"), or None."""
        token_id = self._hf.token_to_id(token)
        return token_id if token_id is not None and token_id < self.vocab_size else None

    def id_to_token(self, token_id: int) -> str:
        """The vocabulary text of a token id."""
        token = self._hf.id_to_token(int(token_id)) if 0 <= int(token_id) < self.vocab_size else None
        if token is None:
            raise ValueError(f"token id {token_id} is outside the vocabulary (size {self.vocab_size})")
        return token

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_token_id is None else self.id_to_token(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return None if self.eos_token_id is None else self.id_to_token(self.eos_token_id)

    @property
    def hf_tokenizer(self) -> HFTokenizer:
        """The underlying `tokenizers.Tokenizer` (for batch encoding, offsets, ...)."""
        return self._hf


def _pieces(text: str) -> Iterator[str]:
    """`text` in consecutive pieces of at most PIECE_CHARS characters, each cut where a word starts after a space
    (where the pre-tokenizers split anyway) when its second half has such a place, else at its end."""
    start = 0
    while len(text) - start > PIECE_CHARS:
        end = start + PIECE_CHARS
        cut = _word_start(text, start + PIECE_CHARS // 2, end) or end
        yield text[start:cut]
        start = cut
    yield text[start:]


def _word_start(text: str, low: int, high: int) -> int | None:
    """The last i in (low, high) with text[i] a space between a non-space and a letter, or None."""
    i = text.rfind(" ", low, high)
    while i > low:
        if not text[i - 1].isspace() and text[i + 1].isalpha():
            return i
        i = text.rfind(" ", low, i)
    return None


# -- Hugging Face directories ---------------------------------------------------------------------------------


def _load_hf_dir(cls: type[Tokenizer], path: Path) -> Tokenizer:
    if not path.is_dir():
        raise ModelFileError(f"{path} is not a directory; pass a Hugging Face model directory")
    tokenizer_json = path / "tokenizer.json"
    if not tokenizer_json.is_file():
        raise ModelFileError(f"{path} has no tokenizer.json; infero needs the fast (tokenizers) tokenizer file")
    try:
        hf = HFTokenizer.from_file(str(tokenizer_json))
    except Exception as e:  # tokenizers raises plain Exception on malformed files
        raise ModelFileError(f"cannot load {tokenizer_json}: {e}") from e
    config = _optional_json(path / "tokenizer_config.json")
    generation = _optional_json(path / "generation_config.json")

    bos_id = _config_token_id(hf, config.get("bos_token"))
    eos_id = _config_token_id(hf, config.get("eos_token"))
    # tokenizer.json's post-processor usually adds BOS; tokenizer_config.json's flags, when present, win
    # (transformers rebuilds the post-processor from them). We add BOS/EOS ourselves so both paths agree.
    probe = hf.encode("", add_special_tokens=True).ids
    probe_bos = bos_id is not None and probe[:1] == [bos_id]
    probe_eos = eos_id is not None and len(probe) > int(probe_bos) and probe[-1] == eos_id
    add_bos = bool(config.get("add_bos_token", probe_bos))
    add_eos = bool(config.get("add_eos_token", probe_eos))
    hf.post_processor = None

    added = hf.get_added_tokens_decoder()
    eog = {i for i in (eos_id,) if i is not None}
    eog.update(_as_id_list(generation.get("eos_token_id")))
    eog.update(i for i, t in added.items() if t.content in gguf_vocab.EOG_TEXTS)
    pieces, strip = _hf_pieces(hf, {i: t.content for i, t in added.items()})
    return cls(
        hf,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        unk_token_id=_config_token_id(hf, config.get("unk_token")),
        pad_token_id=_config_token_id(hf, config.get("pad_token")),
        add_bos=add_bos and bos_id is not None,
        add_eos=add_eos and eos_id is not None,
        eog_token_ids=eog,
        special_token_ids=[i for i, t in added.items() if t.special],
        chat_template=_hf_chat_template(path, config),
        pieces=pieces,
        strip_leading_space=strip,
    )


def _optional_json(path: Path) -> dict[str, Any]:
    return read_json(path) if path.is_file() else {}


def _config_token_id(hf: HFTokenizer, token: Any) -> int | None:
    # tokenizer_config.json writes a special token as its text or as {"content": text, ...}.
    if isinstance(token, dict):
        token = token.get("content")
    return hf.token_to_id(token) if isinstance(token, str) else None


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _hf_chat_template(path: Path, config: Mapping[str, Any]) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default", next(iter(named.values()), None))
    if isinstance(template, str):
        return template
    jinja = path / "chat_template.jinja"  # newer transformers save it beside the config
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    return _optional_json(path / "chat_template.json").get("chat_template")


def _hf_pieces(hf: HFTokenizer, added: Mapping[int, str]) -> tuple[list[bytes] | None, bool]:
    """Per-token bytes for the decoders we understand (byte-level, SentencePiece-style); None otherwise."""
    decoder = json.loads(hf.to_str()).get("decoder")
    steps = decoder.get("decoders", []) if decoder and decoder.get("type") == "Sequence" else [decoder]
    if not steps or any(s is None for s in steps):
        return None, False
    vocab = hf.get_vocab(with_added_tokens=True)
    by_id = [""] * (max(vocab.values(), default=-1) + 1)
    for text, i in vocab.items():
        by_id[i] = text
    if [s.get("type") for s in steps] == ["ByteLevel"]:
        to_latin1 = gguf_vocab.byte_level_table()
        pieces = [
            added[i].encode() if i in added else gguf_vocab.byte_level_bytes(t, to_latin1) for i, t in enumerate(by_id)
        ]
        return pieces, False
    byte_fallback, strip = False, False
    for s in steps:
        kind = s.get("type")
        if kind == "Replace" and s.get("pattern") == {"String": "\u2581"} and s.get("content") == " ":
            continue
        if kind == "ByteFallback":
            byte_fallback = True
        elif kind == "Strip" and s.get("content") == " " and s.get("start") == 1 and s.get("stop") == 0:
            strip = True
        elif kind == "Metaspace" and s.get("replacement") == "\u2581":
            # Metaspace drops the space it prepended (older files say add_prefix_space instead of a scheme).
            scheme = s.get("prepend_scheme", "always" if s.get("add_prefix_space", True) else "never")
            strip = strip or scheme != "never"
        elif kind != "Fuse":
            return None, False
    pieces = []
    for i, text in enumerate(by_id):
        if i in added:
            pieces.append(text.encode())
        elif byte_fallback and (m := gguf_vocab.BYTE_TOKEN.fullmatch(text)):
            pieces.append(bytes([int(m.group(1), 16)]))
        else:
            pieces.append(text.replace("\u2581", " ").encode())
    return pieces, strip


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from a file, with a ModelFileError that names the file when it is not one."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelFileError(f"cannot read {path}: {e}") from e
    if not isinstance(data, dict):
        raise ModelFileError(f"{path} does not hold a JSON object")
    return data
