"""Write tiny random-weight llama-family GGUF models in any tensor type, for tests.

K-quant and IQ tensors hold random but valid blocks (random bits, finite fp16 scales chosen so the decoded
weights have a fixed spread), since the `gguf` package cannot quantize to those types.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

from infero.checkpoint import synthetic

ALL_TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1,
             Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS]  # fmt: skip
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass(frozen=True)
class TinyShape:
    arch: str = "llama"
    hidden: int = 256
    ffn: int = 512
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    tied: bool = False
    context: int = 256


def byte_level_vocab(extra_words: list[str]) -> tuple[list[str], list[str], list[int]]:
    tokens, merges = synthetic.byte_level_vocab(SPECIAL_TOKENS, extra_words)
    return tokens, merges, [3] * len(SPECIAL_TOKENS) + [1] * (len(tokens) - len(SPECIAL_TOKENS))


def add_byte_level_tokenizer(w: gguf.GGUFWriter, tokens: list[str], merges: list[str], types: list[int]) -> None:
    """byte_level_vocab's tokenizer metadata: gpt2 BPE, BOS 1, EOS 2, no BOS added."""
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)


def encode_weight(w: np.ndarray, qtype: Q, rng: np.random.Generator) -> tuple[np.ndarray, Q]:
    return synthetic.encode_weight(w, int(qtype), rng), qtype


def write_tiny_model(
    path: Path,
    qtype: Q = Q.F32,
    shape: TinyShape = TinyShape(),
    seed: int = 0,
    split_max_tensors: int = 0,
    embed_type: Q | None = None,
    chat_template: str | None = CHATML,
    sampling: dict | None = None,
) -> Path:
    """Write a tiny model; matrices in qtype, norms and biases in F32. Returns the (first) file's path. sampling: the
    general.sampling.* keys llama.cpp's converter writes from a generation_config.json, by the gguf writer's
    add_sampling_* name (temp, top_k, top_p, min_p, penalty_repeat, ...)."""
    rng = np.random.default_rng(seed)
    s = shape
    tokens, merges, types = byte_level_vocab(["hello", " world", " the", "ing", " and", "tion", "12"])
    vocab = len(tokens)
    w = gguf.GGUFWriter(str(path), s.arch, split_max_tensors=split_max_tensors)
    w.add_context_length(s.context)
    w.add_embedding_length(s.hidden)
    w.add_block_count(s.layers)
    w.add_feed_forward_length(s.ffn)
    w.add_head_count(s.heads)
    w.add_head_count_kv(s.kv_heads)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_rope_dimension_count(s.head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    add_byte_level_tokenizer(w, tokens, merges, types)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    for name, value in (sampling or {}).items():
        getattr(w, "add_sampling_" + name)(value)

    def matrix(name: str, rows: int, cols: int, qt: Q = qtype, std: float = 0.08) -> None:
        data, t = encode_weight(rng.normal(0, std, size=(rows, cols)).astype(np.float32), qt, rng)
        w.add_tensor(name, data, raw_dtype=None if t in (Q.F32, Q.F16) else t)

    def vector(name: str, n: int, mean: float = 1.0, std: float = 0.1) -> None:
        w.add_tensor(name, (mean + rng.normal(0, std, size=n)).astype(np.float32))

    matrix("token_embd.weight", vocab, s.hidden, embed_type or qtype, std=0.5)
    for i in range(s.layers):
        p = f"blk.{i}."
        vector(p + "attn_norm.weight", s.hidden)
        matrix(p + "attn_q.weight", s.heads * s.head_dim, s.hidden)
        matrix(p + "attn_k.weight", s.kv_heads * s.head_dim, s.hidden)
        matrix(p + "attn_v.weight", s.kv_heads * s.head_dim, s.hidden)
        if s.arch == "qwen2":
            vector(p + "attn_q.bias", s.heads * s.head_dim, 0.0, 0.1)
            vector(p + "attn_k.bias", s.kv_heads * s.head_dim, 0.0, 0.1)
            vector(p + "attn_v.bias", s.kv_heads * s.head_dim, 0.0, 0.1)
        if s.arch == "qwen3":
            vector(p + "attn_q_norm.weight", s.head_dim)
            vector(p + "attn_k_norm.weight", s.head_dim)
        matrix(p + "attn_output.weight", s.hidden, s.heads * s.head_dim)
        vector(p + "ffn_norm.weight", s.hidden)
        matrix(p + "ffn_gate.weight", s.ffn, s.hidden)
        matrix(p + "ffn_up.weight", s.ffn, s.hidden)
        matrix(p + "ffn_down.weight", s.hidden, s.ffn)
    vector("output_norm.weight", s.hidden)
    if not s.tied:
        matrix("output.weight", vocab, s.hidden)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if split_max_tensors:
        return path.with_name(gguf.SHARD_NAME_FORMAT.format(path.stem, 1, len(w.tensors)))
    return path


def tiny_shape(**changes) -> TinyShape:
    return replace(TinyShape(), **changes)
