"""Read the tokenizer out of GGUF metadata and rebuild it as a Hugging Face `tokenizers.Tokenizer`.

Every rule here mirrors llama.cpp (src/llama-vocab.cpp, src/unicode.cpp) so that our token ids equal
llama.cpp's: the pre-tokenizer regex sequences, which tokens are parsed as special, which end generation,
the SentencePiece space prefix, and how each token renders back to bytes.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from infero.errors import ModelFileError, UnsupportedModelError, excerpt

# tokenizer.ggml.token_type values (llama.h: enum llama_token_type).
TOKEN_UNDEFINED, TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = range(7)

# The regexes exactly as llama.cpp's llm_tokenizer_bpe lists them. llama.cpp matches the gpt2/llama3/qwen2
# ones with hand-written splitters that implement these same patterns; Oniguruma (inside `tokenizers`)
# runs them as regexes. Each regex splits every piece left by the previous one, keeping the unmatched gaps
# as pieces of their own: exactly `Split(..., "isolated")`.
GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
LLAMA3_REGEX = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_REGEX = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp classifies characters with tables generated from Unicode 15.1 (src/unicode-data.cpp in the
# llama.cpp that llama-cpp-python 0.3.36 vendors); Oniguruma in tokenizers 0.23 knows Unicode 16.0. The
# characters 16.0 added to L, N and P are "undefined" to llama.cpp, so we take them out of those classes
# (found by comparing the two tables codepoint by codepoint; no other codepoint differs, \s included).
UNICODE_16_ADDITIONS: dict[str, str] = {
    "L": "1C89-1C8A A7CB-A7CD A7DA-A7DC 105C0-105F3 10D4A-10D65 10D6F-10D85 10EC2-10EC4 11380-11389 1138B 1138E "
    "11390-113B5 113B7 113D1 113D3 11BC0-11BE0 13460-143FA 16100-1611D 16D40-16D6C 18CFF 1E5D0-1E5ED 1E5F0",
    "N": "10D40-10D49 116D0-116E3 11BF0-11BF9 16130-16139 16D70-16D79 1CCF0-1CCF9 1E5F1-1E5FA",
    "P": "1B4E-1B4F 1B7F 10D6E 113D4-113D5 113D7-113D8 11BE1 16D6D-16D6F 1E5FF",
}


def llamacpp_unicode_classes(regex: str) -> str:
    """Rewrite \\p{L}, \\p{N} and \\p{P} so that Oniguruma's classes equal llama.cpp's Unicode 15.1 ones.

    `[\\p{L}&&[^...]]` is a class both outside and inside brackets (Oniguruma nests classes).
    """
    for name, ranges in UNICODE_16_ADDITIONS.items():
        excluded = "".join("-".join(f"\\x{{{cp}}}" for cp in r.split("-")) for r in ranges.split())
        regex = regex.replace(f"\\p{{{name}}}", f"[\\p{{{name}}}&&[^{excluded}]]")
    return regex


REGEX_FAMILIES: dict[str, tuple[str, ...]] = {
    "llama3": (LLAMA3_REGEX,),
    "qwen2": (QWEN2_REGEX,),
    "smollm": (r"\p{N}", GPT2_REGEX),
    "gpt2": (GPT2_REGEX,),
    "default": (r"[\p{P}\$\+<=>\^~\|]+", GPT2_REGEX, r"\p{N}+", r"[0-9][0-9][0-9]"),
}


@dataclass(frozen=True)
class PreTokenizerSpec:
    """How llama.cpp pre-tokenizes one `tokenizer.ggml.pre` name."""

    family: str  # key of REGEX_FAMILIES
    ignore_merges: bool = False  # a pre-token that is itself in the vocab is emitted whole
    add_bos: bool = False  # default of tokenizer.ggml.add_bos_token


# tokenizer.ggml.pre names whose regex sequence is one of REGEX_FAMILIES (llama_vocab::impl::load).
# "gpt2" is not a llama.cpp name (it says "gpt-2"); we accept it as the obvious alias.
_PRE_NAMES = {
    PreTokenizerSpec("llama3", ignore_merges=True, add_bos=True): (
        "llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2 jina-v5-nano"
    ),
    PreTokenizerSpec("llama3"): "dbrx smaug-bpe",
    PreTokenizerSpec("qwen2"): "qwen2 deepseek-r1-qwen kormo f2llmv2 megrez stablelm2 hunyuan solar-open",
    PreTokenizerSpec("smollm"): "smollm starcoder refact command-r codeshell exaone minerva-7b mellum2",
    PreTokenizerSpec("gpt2"): "gpt2 gpt-2 phi-2 gigachat a.x-4.0 mellum exaone4 mpt olmo jais trillion granite-docling",
    PreTokenizerSpec("default"): "default",
}
PRE_TOKENIZERS: dict[str, PreTokenizerSpec] = {
    name: spec for spec, names in _PRE_NAMES.items() for name in names.split()
}

# Token texts llama.cpp treats as end of generation (and promotes to control tokens). Space-separated lists.
EOG_TEXTS = frozenset(
    "<|eot_id|> <|im_end|> <|end|> <|return|> <|call|> <|flush|> <|calls|> <end_of_turn> <|endoftext|> </s> "
    "<|eom_id|> <EOT> _<EOT> [EOT] [EOS] <|end_of_text|> <end_of_utterance> <eos> <turn|> <|tool_response> "
    "<｜end▁of▁sentence｜> [e~[".split()
)
EOT_TEXTS = frozenset(
    "<|eot_id|> <|im_end|> <|end|> <end_of_turn> <|endoftext|> <|end_of_text|> <EOT> _<EOT> [EOT] "
    "<｜end▁of▁sentence｜> <end_of_utterance>".split()
)
EOM_TEXTS = frozenset(["<|eom_id|>"])
# Fill-in-the-middle tokens: llama.cpp finds them by text; pad/repo/file-separator also end generation.
FIM_TEXTS: dict[str, frozenset[str]] = {
    kind: frozenset(texts.split())
    for kind, texts in {
        "pre": "<|fim_prefix|> <fim-prefix> <fim_prefix> <｜fim▁begin｜> <PRE> ▁<PRE> <|code_prefix|> <|prefix|>",
        "suf": "<|fim_suffix|> <fim-suffix> <fim_suffix> <｜fim▁hole｜> <SUF> ▁<SUF> <|code_suffix|> <|suffix|>",
        "mid": "<|fim_middle|> <fim-middle> <fim_middle> <｜fim▁end｜> <MID> ▁<MID> <|code_middle|> <|middle|>",
        "pad": "<|fim_pad|> <fim-pad> <fim_pad> <PAD> [PAD]",
        "rep": "<|fim_repo|> <|repo_name|> <fim-repo> <REPO> <reponame>",
        "sep": "<|file_sep|>",
    }.items()
}
FIM_ENDS_GENERATION = ("pad", "rep", "sep")
# gpt-oss: llama.cpp always renders these, whatever the file says.
ALWAYS_RENDERED_TEXTS = frozenset(["<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"])

BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_SPM_SPACE = "\u2581"  # ▁, SentencePiece's visible space
_C_SPACE = " \t\n\v\f\r"  # what C's isspace() accepts: llama.cpp's RSTRIP strips only these


def gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character that stands for each of the 256 bytes."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


@dataclass(frozen=True)
class GGUFVocab:
    """The tokenizer a GGUF file describes, with llama.cpp's derived token attributes applied."""

    model: str  # "gpt2" (byte-level BPE) or "llama" (SentencePiece)
    pre: PreTokenizerSpec | None  # None for SentencePiece
    tokens: list[str]
    token_types: list[int]
    scores: list[float] | None
    merges: list[str]
    bos_id: int | None
    eos_id: int | None
    unk_id: int | None
    pad_id: int | None
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    control_ids: frozenset[int]  # parsed from text, hidden when decoding with skip_special_tokens
    user_defined_ids: frozenset[int]  # parsed from text, always rendered
    rstrip_ids: frozenset[int]  # special tokens that swallow the whitespace after them (Phi-3)
    eog_ids: frozenset[int]
    chat_template: str | None


def _array_of(value: Any, kinds: str) -> bool:
    """Whether value is a numeric array whose dtype kind is one of `kinds` (a list, where the caller built it)."""
    if isinstance(value, list):
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
            return False
        value = np.asarray(value) if value else np.zeros(0, np.int64)
    return isinstance(value, np.ndarray) and value.ndim == 1 and value.dtype.kind in kinds


# What each kind of tokenizer.* value must be: (test, what the error says it must be).
_KINDS = {
    "str": (lambda v: isinstance(v, str), "a string"),
    "flag": (lambda v: isinstance(v, (bool, int)), "a boolean"),
    "int": (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
    "ints": (lambda v: _array_of(v, "iu"), "an array of integers"),
    "numbers": (lambda v: _array_of(v, "iuf"), "an array of numbers"),
    "strs": (lambda v: isinstance(v, list) and all(isinstance(t, str) for t in v), "an array of strings"),
}


def _get(metadata: Mapping[str, Any], key: str, kind: str, default: Any = None) -> Any:
    """metadata[key] (or the default when it is missing), refused with the file's error if it has another type."""
    value = metadata.get(key)
    if value is None:
        return default
    test, noun = _KINDS[kind]
    if not test(value):
        raise ModelFileError(f"GGUF metadata {key} must be {noun}; the file holds {excerpt(value)}: it is broken")
    return value


def _to_int_list(value: Any, key: str, n_tokens: int) -> list[int]:
    if len(value) < n_tokens:
        raise ModelFileError(f"GGUF metadata {key} has {len(value)} entries for {n_tokens} tokens; the file is broken")
    return [int(v) for v in value[:n_tokens]]


def _read_tokens(metadata: Mapping[str, Any]) -> list[str]:
    tokens = _get(metadata, "tokenizer.ggml.tokens", "strs")
    if tokens is None:
        raise ModelFileError(
            "GGUF file has no tokenizer (metadata key tokenizer.ggml.tokens is missing); "
            "use a GGUF converted with its vocabulary or pass the Hugging Face tokenizer directory"
        )
    if not tokens:
        raise ModelFileError("GGUF metadata tokenizer.ggml.tokens is empty: the file has no vocabulary")
    # llama.cpp renames empty tokens so that every text maps to one id.
    tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
    if len(set(tokens)) != len(tokens):
        raise ModelFileError("GGUF metadata tokenizer.ggml.tokens holds the same token text twice; the file is broken")
    return tokens


# GGUF key (tokenizer.ggml.<key>_token_id) of each special token id we read.
_ID_KEYS = {"bos": "bos", "eos": "eos", "unk": "unknown", "pad": "padding"}


def _special_id(metadata: Mapping[str, Any], name: str, default: int | None, n_tokens: int) -> int | None:
    # llama.cpp keeps the default when the file's id is out of range, and drops a default that is.
    if default is not None and default >= n_tokens:
        default = None
    value = _get(metadata, f"tokenizer.ggml.{_ID_KEYS.get(name, name)}_token_id", "int")
    if value is None or not 0 <= value < n_tokens:
        return default
    return value


def _first_with_text(ids_by_text: Mapping[str, int], texts: frozenset[str]) -> int | None:
    # llama.cpp takes whichever match its hash map yields first; the lowest id is our deterministic choice.
    found = [ids_by_text[t] for t in texts if t in ids_by_text]
    return min(found) if found else None


def read_gguf_vocab(metadata: Mapping[str, Any]) -> GGUFVocab:
    """Parse `tokenizer.*` GGUF metadata the way llama.cpp's llama_vocab::impl::load does."""
    model = _get(metadata, "tokenizer.ggml.model", "str")
    if model is None:
        raise ModelFileError(
            "GGUF file has no tokenizer (metadata key tokenizer.ggml.model is missing); "
            "use a GGUF converted with its vocabulary or pass the Hugging Face tokenizer directory"
        )
    if model not in ("gpt2", "llama"):
        raise UnsupportedModelError(
            f"tokenizer model {excerpt(model)} is not supported; infero reads 'gpt2' (byte-level BPE) and 'llama' "
            "(SentencePiece) GGUF tokenizers"
        )
    tokens = _read_tokens(metadata)
    n = len(tokens)
    raw_types = _get(metadata, "tokenizer.ggml.token_type", "ints")
    token_types = _to_int_list(raw_types, "tokenizer.ggml.token_type", n) if raw_types is not None else [1] * n
    raw_scores = _get(metadata, "tokenizer.ggml.scores", "numbers")
    scores = [float(s) for s in raw_scores[:n]] if raw_scores is not None else None
    if scores is not None and len(scores) < n:
        raise ModelFileError(f"GGUF metadata tokenizer.ggml.scores has {len(scores)} entries for {n} tokens")

    if model == "gpt2":
        pre_name = _get(metadata, "tokenizer.ggml.pre", "str") or "default"  # llama.cpp warns and uses 'default'
        pre = PRE_TOKENIZERS.get(pre_name)
        if pre is None:
            raise UnsupportedModelError(
                f"pre-tokenizer {excerpt(pre_name)} (tokenizer.ggml.pre) is not supported; supported: "
                + ", ".join(sorted(PRE_TOKENIZERS))
            )
        merges = _get(metadata, "tokenizer.ggml.merges", "strs", [])
        if not merges:
            raise ModelFileError("GGUF BPE tokenizer has no merges (tokenizer.ggml.merges is missing or empty)")
        # llama.cpp falls back to id 11 (Falcon's) for a BPE file without BOS/EOS ids; we do not guess.
        defaults = {"bos": None, "eos": None, "unk": None, "pad": None}
        add_bos_default, add_space_prefix = pre.add_bos, False
    else:
        pre, merges = None, []
        if scores is None:
            raise ModelFileError("GGUF SentencePiece tokenizer has no scores (tokenizer.ggml.scores is missing)")
        defaults = {"bos": 1, "eos": 2, "unk": 0, "pad": None}
        add_bos_default, add_space_prefix = True, True

    add_space_prefix = bool(_get(metadata, "tokenizer.ggml.add_space_prefix", "flag", add_space_prefix))
    ids = {name: _special_id(metadata, name, default, n) for name, default in defaults.items()}
    add_bos = bool(_get(metadata, "tokenizer.ggml.add_bos_token", "flag", add_bos_default))
    add_eos = bool(_get(metadata, "tokenizer.ggml.add_eos_token", "flag", False))
    if add_bos and ids["bos"] is None:
        raise ModelFileError("GGUF tokenizer.ggml.add_bos_token is true but there is no valid bos_token_id")
    if add_eos and ids["eos"] is None:
        raise ModelFileError("GGUF tokenizer.ggml.add_eos_token is true but there is no valid eos_token_id")

    control, user_defined, eog = _token_attributes(metadata, tokens, token_types, ids["eos"])
    rstrip = _rstrip_ids(metadata, tokens, control | user_defined)
    template = _get(metadata, "tokenizer.chat_template", "str")
    return GGUFVocab(
        model=model,
        pre=pre,
        tokens=tokens,
        token_types=token_types,
        scores=scores,
        merges=merges,
        bos_id=ids["bos"],
        eos_id=ids["eos"],
        unk_id=ids["unk"],
        pad_id=ids["pad"],
        add_bos=add_bos,
        add_eos=add_eos,
        add_space_prefix=add_space_prefix,
        control_ids=control,
        user_defined_ids=user_defined,
        rstrip_ids=rstrip,
        eog_ids=eog,
        chat_template=template,
    )


def _token_attributes(
    metadata: Mapping[str, Any], tokens: list[str], token_types: list[int], eos_id: int | None
) -> tuple[frozenset[int], frozenset[int], frozenset[int]]:
    """Control ids, user-defined ids and end-of-generation ids, after llama.cpp's by-text corrections."""
    n = len(tokens)
    # UNKNOWN tokens behave like control tokens: parsed from text, hidden unless special tokens are rendered.
    control = {i for i, t in enumerate(token_types) if t in (TOKEN_CONTROL, TOKEN_UNKNOWN)}
    user_defined = {i for i, t in enumerate(token_types) if t == TOKEN_USER_DEFINED}
    ids_by_text = {t: i for i, t in enumerate(tokens)}

    found: dict[str, int | None] = {
        "eot": _special_id(metadata, "eot", None, n),
        "eom": _special_id(metadata, "eom", None, n),
    }
    for kind in FIM_TEXTS:
        found[kind] = _special_id(metadata, f"fim_{kind}", None, n)
    if found["pre"] is None:  # deprecated key names of the same ids
        found["pre"] = _special_id(metadata, "prefix", None, n)
    if found["suf"] is None:
        found["suf"] = _special_id(metadata, "suffix", None, n)
    if found["mid"] is None:
        found["mid"] = _special_id(metadata, "middle", None, n)
    texts = {"eot": EOT_TEXTS, "eom": EOM_TEXTS, **FIM_TEXTS}
    for kind, candidates in texts.items():
        if found[kind] is None:
            found[kind] = _first_with_text(ids_by_text, candidates)
            if found[kind] is not None:  # a token found by its text is promoted to a control token
                control.add(found[kind])

    eog = {found[k] for k in FIM_ENDS_GENERATION if found[k] is not None}
    for text in EOG_TEXTS & ids_by_text.keys():
        eog.add(ids_by_text[text])
        control.add(ids_by_text[text])
    for text in ALWAYS_RENDERED_TEXTS & ids_by_text.keys():
        control.discard(ids_by_text[text])
        user_defined.add(ids_by_text[text])
    eog.update(i for i in (eos_id, found["eot"], found["eom"]) if i is not None)

    eog_texts = {tokens[i] for i in eog}
    # gpt-oss / solar-open: "<|end|>" ends a message, not the generation, when these are present.
    if "<|end|>" in eog_texts and (
        ("<|return|>" in eog_texts and eog_texts & {"<|call|>", "<|calls|>"})
        or (eog_texts & {"<|call|>", "<|calls|>"} and "<|flush|>" in eog_texts)
    ):
        end = ids_by_text["<|end|>"]
        eog.discard(end)
        control.discard(end)
        user_defined.add(end)
    # gemma4 / plamo: "</s>" is an ordinary token there.
    if "</s>" in eog_texts and eog_texts & {"<|tool_response>", "<|plamo:eos|>"}:
        s = ids_by_text["</s>"]
        eog.discard(s)
        control.discard(s)
        user_defined.discard(s)
    return frozenset(control), frozenset(user_defined - control), frozenset(eog)


def _rstrip_ids(metadata: Mapping[str, Any], tokens: list[str], special: frozenset[int]) -> frozenset[int]:
    # llama.cpp sets RSTRIP on Phi-3's special tokens (found by general.name) except <unk>, <s>, <|endoftext|>.
    name = str(metadata.get("general.name", "")).lower()
    if "phi-3" not in name and "phi3" not in name:
        return frozenset()
    keep = {"<unk>", "<s>", "<|endoftext|>"}
    ids = {i for i in special if tokens[i] not in keep}
    ids.update(i for i, t in enumerate(tokens) if t == "</s>")
    return frozenset(ids)


def special_tokens(vocab: GGUFVocab) -> list[AddedToken]:
    """Tokens llama.cpp cuts out of the text before tokenizing (control, unknown and user-defined).

    RSTRIP is not handed to `tokenizers`: it strips Unicode whitespace where llama.cpp strips only ASCII
    whitespace (C isspace), so `Tokenizer.encode` does the stripping itself (see `rstrip_pattern`).
    """
    ids = sorted(vocab.control_ids | vocab.user_defined_ids)
    return [AddedToken(vocab.tokens[i], special=i in vocab.control_ids, normalized=False) for i in ids]


class SpecialTokenSplitter:
    """llama.cpp's tokenizer_st_partition: cut special tokens out of the text, longest token first.

    `tokenizers` finds added tokens leftmost-longest in one pass. That gives the same fragments unless a
    suffix of one special token is a prefix of another: in "{{x}}}}" with "{{x}" and "x}}}}", llama.cpp takes
    the longer "x}}}}" and `tokenizers` the leftmost "{{x}". Vocabularies where that can happen (see
    `has_partial_overlap`) are split with this class instead.
    """

    def __init__(self, specials: Sequence[tuple[str, int]], rstrip_ids: frozenset[int] = frozenset()) -> None:
        # llama.cpp sorts by length with std::sort, which leaves equal lengths in no set order; lower id first.
        self._specials = sorted(specials, key=lambda s: (-len(s[0]), s[1]))
        self._rstrip_ids = rstrip_ids

    def split(self, text: str) -> list[str | int]:
        """The text as raw-text fragments (str) and special token ids (int), in order."""
        fragments: list[str | int] = [text] if text else []
        for special, token_id in self._specials:
            if not any(isinstance(f, str) and special in f for f in fragments):
                continue
            out: list[str | int] = []
            for fragment in fragments:
                if isinstance(fragment, int) or special not in fragment:
                    out.append(fragment)
                    continue
                first, *rest = fragment.split(special)  # leftmost, non-overlapping: as llama.cpp's find loop
                if first:
                    out.append(first)
                for part in rest:
                    out.append(token_id)
                    if token_id in self._rstrip_ids:
                        part = part.lstrip(_C_SPACE)
                    if part:
                        out.append(part)
            fragments = out
        return fragments


def has_partial_overlap(texts: Sequence[str]) -> bool:
    """Whether a proper suffix of one text is a proper prefix of another (or of itself).

    Compared by polynomial hashes (mod 2^61 - 1) of every proper prefix and suffix, a match confirmed character
    by character, in time and memory linear in the texts' total length: a set of the prefixes themselves takes the
    square of a long token's length (gigabytes for a 100,000-character special token in a corrupt file).
    """
    base, mod = _HASH_BASE, _HASH_MOD
    prefix_of: dict[int, str] = {}  # hash of (length, prefix) -> the prefix's text
    for t in texts:
        h = 0
        for k in range(1, len(t)):
            h = (h * base + ord(t[k - 1])) % mod
            prefix_of.setdefault(h ^ (k << 61), t)
    for t in texts:
        h, power, n = 0, 1, len(t)
        for k in range(n - 1, 0, -1):  # the suffix t[k:], grown one character at a time from the end
            h = (ord(t[k]) * power + h) % mod
            power = power * base % mod
            u = prefix_of.get(h ^ ((n - k) << 61))
            if u is not None and u.startswith(t[k:]):
                return True
    return False


_HASH_BASE, _HASH_MOD = 1_000_003, (1 << 61) - 1


def special_splitter(vocab: GGUFVocab) -> SpecialTokenSplitter | None:
    """The exact llama.cpp splitter when `tokenizers`' own added-token matching could differ from it."""
    ids = sorted(vocab.control_ids | vocab.user_defined_ids)
    if not has_partial_overlap([vocab.tokens[i] for i in ids]):
        return None
    return SpecialTokenSplitter([(vocab.tokens[i], i) for i in ids], vocab.rstrip_ids)


def rstrip_pattern(texts: Sequence[str]) -> re.Pattern[str] | None:
    """Matches an RSTRIP token and the ASCII whitespace after it (what llama.cpp's isspace() accepts)."""
    if not texts:
        return None
    alternatives = "|".join(re.escape(t) for t in sorted(texts, key=len, reverse=True))
    return re.compile(f"({alternatives})[{_C_SPACE}]+")


def build_hf_tokenizer(vocab: GGUFVocab) -> HFTokenizer:
    """A `tokenizers.Tokenizer` that produces llama.cpp's token ids for this vocabulary."""
    ids_by_text = {t: i for i, t in enumerate(vocab.tokens)}
    if vocab.model == "gpt2":
        hf = _build_bpe(vocab, ids_by_text)
    else:
        hf = _build_spm(vocab, ids_by_text)
    specials = special_tokens(vocab)
    hf.add_special_tokens([t for t in specials if t.special])
    hf.add_tokens([t for t in specials if not t.special])
    return hf


def _build_bpe(vocab: GGUFVocab, ids_by_text: dict[str, int]) -> HFTokenizer:
    merges: list[tuple[str, str]] = []
    seen: set[tuple[str, str]] = set()
    for line in vocab.merges:
        pos = line.find(" ", 1)  # llama.cpp splits at the first space after the first character
        if pos < 0:
            continue
        pair = (line[:pos], line[pos + 1 :])
        # `tokenizers` refuses merges whose parts or result are not tokens; llama.cpp could never emit such a
        # result as one token either. The first occurrence of a pair gives its rank, as in llama.cpp.
        if pair in seen or pair[0] not in ids_by_text or pair[1] not in ids_by_text:
            continue
        if pair[0] + pair[1] not in ids_by_text:
            continue
        seen.add(pair)
        merges.append(pair)
    assert vocab.pre is not None
    # A byte whose character is not in the vocabulary stays a symbol in llama.cpp's BPE (it keeps its
    # neighbours apart, so they cannot merge) and is dropped from the output at the end; `tokenizers` drops it
    # before merging. Phantom tokens past the vocabulary keep it in place; Tokenizer.encode drops their ids.
    model_vocab = dict(ids_by_text)
    for char in gpt2_byte_decoder():
        model_vocab.setdefault(char, len(model_vocab))
    hf = HFTokenizer(models.BPE(vocab=model_vocab, merges=merges, ignore_merges=vocab.pre.ignore_merges))
    splits = [
        pre_tokenizers.Split(Regex(llamacpp_unicode_classes(r)), behavior="isolated")
        for r in REGEX_FAMILIES[vocab.pre.family]
    ]
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    hf.decoder = decoders.ByteLevel()
    return hf


def spm_merges(tokens: Sequence[str], scores: Sequence[float], mergeable: Sequence[bool]) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece's score-driven merging.

    llama.cpp's SPM tokenizer repeatedly merges the adjacent pair whose concatenation is the vocabulary
    token with the highest score. A BPE merge list that ranks every split (a, b) of every token by that
    token's score makes `tokenizers`' BPE do the same (this is how HF converts Llama's tokenizer too).
    """
    ids_by_text = {t: i for i, t in enumerate(tokens)}
    lengths = {len(t) for t in tokens}  # a cut whose halves have no token's length is skipped without slicing
    ranked: list[tuple[float, int, int, tuple[str, str]]] = []
    for i, text in enumerate(tokens):
        if not mergeable[i] or len(text) < 2:
            continue
        for cut in range(1, len(text)):
            if cut not in lengths or len(text) - cut not in lengths:
                continue
            left, right = text[:cut], text[cut:]
            if left in ids_by_text and right in ids_by_text:
                ranked.append((-scores[i], i, cut, (left, right)))
    ranked.sort()
    return [pair for *_, pair in ranked]


def _build_spm(vocab: GGUFVocab, ids_by_text: dict[str, int]) -> HFTokenizer:
    assert vocab.scores is not None
    special = vocab.control_ids | vocab.user_defined_ids
    mergeable = [i not in special and t != TOKEN_BYTE for i, t in enumerate(vocab.token_types)]
    merges = spm_merges(vocab.tokens, vocab.scores, mergeable)
    unk = vocab.tokens[vocab.unk_id] if vocab.unk_id is not None else None
    hf = HFTokenizer(models.BPE(vocab=ids_by_text, merges=merges, unk_token=unk, byte_fallback=True, fuse_unk=True))
    # llama.cpp puts a space before the first text fragment and before every fragment that follows a
    # special token, then writes spaces as ▁. `tokenizers` normalizes each fragment between added tokens
    # separately, so a Prepend normalizer does exactly that.
    steps = [normalizers.Replace(" ", _SPM_SPACE)]
    if vocab.add_space_prefix:
        steps.insert(0, normalizers.Prepend(_SPM_SPACE))
    hf.normalizer = normalizers.Sequence(steps)
    hf.decoder = decoders.Sequence(
        [
            decoders.Replace(_SPM_SPACE, " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            *([decoders.Strip(" ", 1, 0)] if vocab.add_space_prefix else []),
        ]
    )
    return hf


def piece_bytes(vocab: GGUFVocab) -> list[bytes]:
    """The bytes each token renders to, as llama.cpp's token_to_piece(special=True) gives them."""
    to_latin1 = byte_level_table() if vocab.model == "gpt2" else None
    special = vocab.control_ids | vocab.user_defined_ids
    out = []
    for i, (text, ttype) in enumerate(zip(vocab.tokens, vocab.token_types, strict=True)):
        if i in special:
            out.append(text.encode())
        elif ttype == TOKEN_BYTE and (m := BYTE_TOKEN.fullmatch(text)):
            out.append(bytes([int(m.group(1), 16)]))
        elif ttype != TOKEN_NORMAL:
            out.append(b"")  # llama.cpp renders unused and undefined tokens as nothing
        elif to_latin1 is None:
            out.append(text.replace(_SPM_SPACE, " ").encode())
        else:
            out.append(byte_level_bytes(text, to_latin1))
    return out


def byte_level_table() -> dict[int, str]:
    """A str.translate table from GPT-2's byte characters to the latin-1 character of the same byte.

    Characters below 256 that are not in the alphabet map to U+FFFF, so that they fail the latin-1 encoding
    in `byte_level_bytes` like every other character outside the alphabet.
    """
    table = {c: "\uffff" for c in range(256)}
    table.update({ord(char): chr(byte) for char, byte in gpt2_byte_decoder().items()})
    return table


def byte_level_bytes(text: str, to_latin1: Mapping[int, str]) -> bytes:
    """Undo GPT-2's byte-to-character mapping; a token outside that alphabet is taken as plain UTF-8."""
    try:
        return text.translate(to_latin1).encode("latin-1")
    except UnicodeEncodeError:
        # llama.cpp writes "[UNK_BYTE_0x..]" here; the token's own text is the more useful rendering.
        return text.encode()
