#!/usr/bin/env python3
"""Write tiny random-weight GGUF models for tests (tests/fixtures/models/).

Needs only numpy and gguf (GGUFWriter); run it in the main venv:

    .venv/bin/python scripts/make_tiny_models.py            # write models + SHA256SUMS
    .venv/bin/python scripts/make_tiny_models.py --check    # rebuild in memory, compare with SHA256SUMS

Every model is generated the way a real checkpoint reaches us: first an HF-layout state dict
(``hf_state_dict(spec)``, names and shapes as in transformers' ``LlamaForCausalLM`` /
``Qwen2ForCausalLM`` / ``Qwen3ForCausalLM``) drawn from a fixed seed, then written as llama.cpp's
``convert_hf_to_gguf.py`` writes it: GGUF tensor names, ``{arch}.*`` metadata, and for ``llama`` the
rows of Q and K permuted with the converter's ``permute(weights, n_head, n_head_kv)`` (qwen2/qwen3 are
not permuted: llama.cpp runs them with NEOX rope). ``scripts/make_logit_fixtures.py`` imports this file
to rebuild the same HF state dict when it needs to bypass transformers' GGUF loader.

Output is byte-for-byte deterministic (fixed seeds, no timestamps), so SHA256SUMS pins it.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import sys
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
OUT_DIR = REPO / "tests" / "fixtures" / "models"


# --------------------------------------------------------------------------------------------------
# Model specs
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TinySpec:
    name: str  # file stem: tests/fixtures/models/{name}.gguf
    arch: str  # GGUF general.architecture: llama | qwen2 | qwen3
    seed: int
    hidden: int = 64
    n_head: int = 4
    n_kv_head: int = 2
    head_dim: int = 16
    n_layer: int = 2
    ffn: int = 128
    vocab: int = 300
    context_length: int = 256
    rms_eps: float = 1e-5
    rope_theta: float = 10000.0
    tied: bool = False  # no output.weight; lm_head = token_embd
    qkv_bias: bool = False  # qwen2
    qk_norm: bool = False  # qwen3 per-head RMSNorm on q and k (weights of size head_dim)
    # llama-3.1 style rope scaling: written to GGUF as rope_freqs.weight (per-dimension divisor)
    rope_scaling: dict | None = field(default=None, hash=False, compare=False)
    embed_std: float = 0.5  # token_embd std (smaller when tied, else each token's logit is dominated by itself)
    ftype: str = "F32"  # F32: every tensor f32; F16: 2-D tensors f16, 1-D tensors f32 (converter --outtype f16)
    description: str = ""


LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Small on purpose: with head_dim 16 and theta 1e4 the wavelengths are 6.3 .. 19869, so an
    # original context of 64 puts dims in all three regimes (kept, smoothed, divided by 8) and the
    # scaled dims already matter within a 40-token prompt.
    "original_max_position_embeddings": 64,
}

_LLAMA = TinySpec(
    name="tiny-llama-gqa",
    arch="llama",
    seed=1001,
    description="llama, GQA (4 q heads / 2 kv heads), separate output.weight, Q/K rows permuted",
)

SPECS: list[TinySpec] = [
    _LLAMA,
    replace(
        _LLAMA,
        name="tiny-llama-gqa-f16",
        ftype="F16",
        description="tiny-llama-gqa's weights (same seed) with 2-D tensors stored F16, norms F32",
    ),
    TinySpec(
        name="tiny-llama-tied",
        arch="llama",
        seed=1002,
        tied=True,
        embed_std=0.15,
        description="llama with tied embeddings: no output.weight, lm_head = token_embd.weight",
    ),
    TinySpec(
        name="tiny-llama-rope-freqs",
        arch="llama",
        seed=1003,
        rope_scaling=LLAMA3_SCALING,
        description="llama with rope_freqs.weight (llama-3.1 rope scaling, per-dimension theta divisor)",
    ),
    TinySpec(
        name="tiny-qwen2",
        arch="qwen2",
        seed=1004,
        qkv_bias=True,
        rms_eps=1e-6,
        rope_theta=1000000.0,
        description="qwen2: q/k/v biases, no permutation (NEOX rope)",
    ),
    TinySpec(
        name="tiny-qwen3",
        arch="qwen3",
        seed=1005,
        head_dim=128,
        qk_norm=True,
        rms_eps=1e-6,
        rope_theta=1000000.0,
        description="qwen3: per-head q_norm/k_norm, head_dim 128 != hidden/heads (key_length/value_length)",
    ),
]


def spec_by_name(name: str) -> TinySpec:
    for s in SPECS:
        if s.name == name:
            return s
    raise KeyError(name)


# --------------------------------------------------------------------------------------------------
# HF-layout weights
# --------------------------------------------------------------------------------------------------

# std of the random weights. Inputs to every projection are RMS-normalised (~unit RMS), so
# std ~ 0.8/sqrt(fan_in) keeps every activation O(1) and the logits spread (std ~1-2), not flat.
STD_PROJ = 0.1  # fan_in 64
STD_DOWN = 0.07  # fan_in 128
STD_LM_HEAD = 0.2
STD_BIAS = 0.1
NORM_JITTER = 0.1  # norm weights ~ 1 + 0.1 * N(0, 1)


def hf_state_dict(spec: TinySpec) -> dict[str, np.ndarray]:
    """HF-layout float32 weights (transformers names, [out, in] matrices), drawn in a fixed order."""
    rng = np.random.default_rng(spec.seed)
    H, nh, nkv, hd, F, V = spec.hidden, spec.n_head, spec.n_kv_head, spec.head_dim, spec.ffn, spec.vocab

    def normal(shape, std):
        return (rng.standard_normal(shape, dtype=np.float64) * std).astype(np.float32)

    def norm_w(n):
        return (1.0 + rng.standard_normal(n, dtype=np.float64) * NORM_JITTER).astype(np.float32)

    sd: dict[str, np.ndarray] = {}
    sd["model.embed_tokens.weight"] = normal((V, H), spec.embed_std)
    for i in range(spec.n_layer):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = norm_w(H)
        sd[p + "self_attn.q_proj.weight"] = normal((nh * hd, H), STD_PROJ)
        sd[p + "self_attn.k_proj.weight"] = normal((nkv * hd, H), STD_PROJ)
        sd[p + "self_attn.v_proj.weight"] = normal((nkv * hd, H), STD_PROJ)
        if spec.qkv_bias:
            sd[p + "self_attn.q_proj.bias"] = normal((nh * hd,), STD_BIAS)
            sd[p + "self_attn.k_proj.bias"] = normal((nkv * hd,), STD_BIAS)
            sd[p + "self_attn.v_proj.bias"] = normal((nkv * hd,), STD_BIAS)
        if spec.qk_norm:
            sd[p + "self_attn.q_norm.weight"] = norm_w(hd)
            sd[p + "self_attn.k_norm.weight"] = norm_w(hd)
        sd[p + "self_attn.o_proj.weight"] = normal((H, nh * hd), STD_PROJ * math.sqrt(H / (nh * hd)))
        sd[p + "post_attention_layernorm.weight"] = norm_w(H)
        sd[p + "mlp.gate_proj.weight"] = normal((F, H), STD_PROJ)
        sd[p + "mlp.up_proj.weight"] = normal((F, H), STD_PROJ)
        sd[p + "mlp.down_proj.weight"] = normal((H, F), STD_DOWN)
    sd["model.norm.weight"] = norm_w(H)
    if not spec.tied:
        sd["lm_head.weight"] = normal((V, H), STD_LM_HEAD)
    return sd


def llama3_rope_factors(spec: TinySpec) -> np.ndarray:
    """rope_freqs.weight exactly as convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors makes it."""
    rp = spec.rope_scaling
    assert rp is not None and rp["rope_type"] == "llama3"
    base, dim = spec.rope_theta, spec.head_dim
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor = rp.get("factor", 8.0)
    low_freq_factor = rp.get("low_freq_factor", 1.0)
    high_freq_factor = rp.get("high_freq_factor", 4.0)
    old_context_len = rp.get("original_max_position_embeddings", 8192)
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / float(freq)
        if wavelen < high_freq_wavelen:
            out.append(1.0)
        elif wavelen > low_freq_wavelen:
            out.append(factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def permute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.permute: HF rotate-half row order -> GGML interleaved pairs."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def gguf_tensors(spec: TinySpec) -> list[tuple[str, np.ndarray]]:
    """(GGUF name, array) in the converter's order, HF weights mapped and permuted as it does."""
    sd = hf_state_dict(spec)
    out: list[tuple[str, np.ndarray]] = []
    if spec.rope_scaling is not None:
        out.append(("rope_freqs.weight", llama3_rope_factors(spec)))  # extra tensors come first
    out.append(("token_embd.weight", sd["model.embed_tokens.weight"]))
    for i in range(spec.n_layer):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        q = sd[p + "self_attn.q_proj.weight"]
        k = sd[p + "self_attn.k_proj.weight"]
        if spec.arch == "llama":
            q = permute(q, spec.n_head, spec.n_head)
            k = permute(k, spec.n_head, spec.n_kv_head)
        out.append((b + "attn_norm.weight", sd[p + "input_layernorm.weight"]))
        out.append((b + "attn_q.weight", q))
        out.append((b + "attn_k.weight", k))
        out.append((b + "attn_v.weight", sd[p + "self_attn.v_proj.weight"]))
        if spec.qkv_bias:
            out.append((b + "attn_q.bias", sd[p + "self_attn.q_proj.bias"]))
            out.append((b + "attn_k.bias", sd[p + "self_attn.k_proj.bias"]))
            out.append((b + "attn_v.bias", sd[p + "self_attn.v_proj.bias"]))
        if spec.qk_norm:
            out.append((b + "attn_q_norm.weight", sd[p + "self_attn.q_norm.weight"]))
            out.append((b + "attn_k_norm.weight", sd[p + "self_attn.k_norm.weight"]))
        out.append((b + "attn_output.weight", sd[p + "self_attn.o_proj.weight"]))
        out.append((b + "ffn_norm.weight", sd[p + "post_attention_layernorm.weight"]))
        out.append((b + "ffn_gate.weight", sd[p + "mlp.gate_proj.weight"]))
        out.append((b + "ffn_up.weight", sd[p + "mlp.up_proj.weight"]))
        out.append((b + "ffn_down.weight", sd[p + "mlp.down_proj.weight"]))
    out.append(("output_norm.weight", sd["model.norm.weight"]))
    if not spec.tied:
        out.append(("output.weight", sd["lm_head.weight"]))
    out = [(n, np.ascontiguousarray(a)) for n, a in out]
    if spec.ftype == "F16":  # converter --outtype f16: 2-D -> f16, 1-D (norms, biases, rope_freqs) stay f32
        out = [(n, a.astype(np.float16) if a.ndim >= 2 else a) for n, a in out]
    return out


# --------------------------------------------------------------------------------------------------
# Tokenizer: a gpt2-style byte-level BPE, trained (deterministically) on a fixed tiny corpus
# --------------------------------------------------------------------------------------------------

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2 (as in SmolLM2)
BOS_ID, EOS_ID, UNK_ID, PAD_ID = 1, 2, 0, 2
TOKEN_NORMAL, TOKEN_CONTROL = 1, 3  # gguf.TokenType values

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

CORPUS = (
    "the quick brown fox jumps over the lazy dog. the dog sleeps and the fox runs. "
    "hello world! hello there, this is a tiny test of the tokenizer in the inference engine. "
    "there is an answer to the question: the answer is in the text, and the text is short. "
    "tokens and merges, tokens and types, the end of the text is the end of the test."
)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character map."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs], strict=True))


def build_tokenizer(vocab_size: int) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token_types, merges): specials, 256 byte symbols, then BPE merges up to vocab_size."""
    b2u = bytes_to_unicode()
    byte_syms = [b2u[b] for b in range(256)]
    n_merges = vocab_size - len(SPECIAL_TOKENS) - len(byte_syms)
    assert n_merges >= 0
    # pre-tokenise like gpt2: words keep their leading space (which maps to 'Ġ')
    words: dict[tuple[str, ...], int] = {}
    for i, w in enumerate(CORPUS.split(" ")):
        piece = (" " if i else "") + w
        sym = tuple(b2u[b] for b in piece.encode("utf-8"))
        words[sym] = words.get(sym, 0) + 1
    merges: list[str] = []
    merged_tokens: list[str] = []
    for _ in range(n_merges):
        counts: dict[tuple[str, str], int] = {}
        for w, c in words.items():
            for a, b in zip(w, w[1:], strict=False):
                counts[(a, b)] = counts.get((a, b), 0) + c
        if not counts:
            break
        best = min(counts, key=lambda p: (-counts[p], p))  # most frequent, ties lexicographic
        merges.append(f"{best[0]} {best[1]}")
        merged_tokens.append(best[0] + best[1])
        new_words: dict[tuple[str, ...], int] = {}
        for w, c in words.items():
            out, j = [], 0
            while j < len(w):
                if j + 1 < len(w) and (w[j], w[j + 1]) == best:
                    out.append(w[j] + w[j + 1])
                    j += 2
                else:
                    out.append(w[j])
                    j += 1
            new_words[tuple(out)] = new_words.get(tuple(out), 0) + c
        words = new_words
    tokens = SPECIAL_TOKENS + byte_syms + merged_tokens
    assert len(tokens) == vocab_size, (len(tokens), vocab_size)
    assert len(set(tokens)) == len(tokens)
    types = [TOKEN_CONTROL] * len(SPECIAL_TOKENS) + [TOKEN_NORMAL] * (len(tokens) - len(SPECIAL_TOKENS))
    return tokens, types, merges


# --------------------------------------------------------------------------------------------------
# GGUF writing
# --------------------------------------------------------------------------------------------------


def write_gguf(spec: TinySpec, path: Path) -> None:
    import gguf

    w = gguf.GGUFWriter(str(path), spec.arch)
    w.add_type("model")
    w.add_name(spec.name)
    w.add_description(spec.description)
    w.add_block_count(spec.n_layer)
    w.add_context_length(spec.context_length)
    w.add_embedding_length(spec.hidden)
    w.add_feed_forward_length(spec.ffn)
    w.add_head_count(spec.n_head)
    w.add_head_count_kv(spec.n_kv_head)
    w.add_rope_freq_base(spec.rope_theta)
    w.add_layer_norm_rms_eps(spec.rms_eps)
    if spec.head_dim != spec.hidden // spec.n_head:
        w.add_key_length(spec.head_dim)
        w.add_value_length(spec.head_dim)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if spec.ftype == "F16" else gguf.LlamaFileType.ALL_F32)
    w.add_vocab_size(spec.vocab)
    w.add_rope_dimension_count(spec.head_dim)

    tokens, types, merges = build_tokenizer(spec.vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(BOS_ID)
    w.add_eos_token_id(EOS_ID)
    w.add_unk_token_id(UNK_ID)
    w.add_pad_token_id(PAD_ID)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)

    for name, arr in gguf_tensors(spec):
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=OUT_DIR)
    ap.add_argument("--check", action="store_true", help="rebuild in a temp dir and compare with SHA256SUMS")
    args = ap.parse_args(argv)

    if args.check:
        sums_file = args.out / "SHA256SUMS"
        want = dict(reversed(line.split()) for line in sums_file.read_text().splitlines() if line.strip())
        bad = 0
        with tempfile.TemporaryDirectory() as td:
            for spec in SPECS:
                fname = spec.name + ".gguf"
                write_gguf(spec, Path(td) / fname)
                got = sha256(Path(td) / fname)
                ok = want.get(fname) == got
                bad += not ok
                print(f"{'ok  ' if ok else 'DIFF'} {fname}")
        return 1 if bad else 0

    args.out.mkdir(parents=True, exist_ok=True)
    lines = []
    for spec in SPECS:
        path = args.out / (spec.name + ".gguf")
        write_gguf(spec, path)
        lines.append(f"{sha256(path)}  {path.name}")
        print(f"{path.relative_to(REPO) if path.is_relative_to(REPO) else path}  {os.path.getsize(path):>9,d} B")
    # the GGUFs only: the logit .npz files carry their model's sha256 in their own metadata instead
    (args.out / "SHA256SUMS").write_text("\n".join(sorted(lines, key=lambda s: s.split()[-1])) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
