"""Write tiny random-weight qwen3moe GGUF models, whole or broken on purpose, for tests."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q
from tiny_gguf import CHATML, add_byte_level_tokenizer, byte_level_vocab, encode_weight

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 64, 4, 2, 16, 2


def write_tiny_moe(
    path: Path,
    experts: int = 8,
    used: int = 2,
    expert_ffn: int = 32,
    qtype: Q = Q.F32,
    seed: int = 0,
    expert_count_key: int | None = None,
    drop: tuple[str, ...] = (),
    head_dim: int = HEAD_DIM,
    hidden: int = HIDDEN,
) -> Path:
    """A 2-layer qwen3moe with `experts` experts of width expert_ffn, `used` of them per token; matrices in qtype
    (expert tensors 3-D, one matrix per expert). expert_count_key writes another expert_count than the tensors
    hold; tensors named in drop are left out; head_dim 64 for the GPU backend, whose attention takes 64 and 128; hidden
    the model's width."""
    rng = np.random.default_rng(seed)
    tokens, merges, types = byte_level_vocab(["hello", " world", " the", "ing", " and", "tion", "12"])
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(4 * expert_ffn)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(1000000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_expert_count(experts if expert_count_key is None else expert_count_key)
    w.add_expert_used_count(used)
    w.add_expert_feed_forward_length(expert_ffn)
    add_byte_level_tokenizer(w, tokens, merges, types)
    w.add_chat_template(CHATML)

    def add(name: str, data: np.ndarray, qt: Q = Q.F32) -> None:
        if name not in drop:
            w.add_tensor(name, data, raw_dtype=None if qt in (Q.F32, Q.F16) else qt)

    def matrix(name: str, *shape: int, std: float = 0.1) -> None:
        rows = rng.normal(0, std, size=(int(np.prod(shape[:-1])), shape[-1])).astype(np.float32)
        data, t = encode_weight(rows, qtype, rng)
        add(name, data.reshape(*shape[:-1], data.shape[-1]), t)

    def vector(name: str, n: int) -> None:
        add(name, (1.0 + rng.normal(0, 0.1, size=n)).astype(np.float32))

    matrix("token_embd.weight", len(tokens), hidden, std=0.5)
    for i in range(LAYERS):
        p = f"blk.{i}."
        vector(p + "attn_norm.weight", hidden)
        matrix(p + "attn_q.weight", HEADS * head_dim, hidden)
        matrix(p + "attn_k.weight", KV_HEADS * head_dim, hidden)
        matrix(p + "attn_v.weight", KV_HEADS * head_dim, hidden)
        vector(p + "attn_q_norm.weight", head_dim)
        vector(p + "attn_k_norm.weight", head_dim)
        matrix(p + "attn_output.weight", hidden, HEADS * head_dim)
        vector(p + "ffn_norm.weight", hidden)
        add(p + "ffn_gate_inp.weight", rng.normal(0, 0.3, size=(experts, hidden)).astype(np.float32))
        matrix(p + "ffn_gate_exps.weight", experts, expert_ffn, hidden)
        matrix(p + "ffn_up_exps.weight", experts, expert_ffn, hidden)
        matrix(p + "ffn_down_exps.weight", experts, hidden, expert_ffn, std=0.15)
    vector("output_norm.weight", hidden)
    matrix("output.weight", len(tokens), hidden)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
