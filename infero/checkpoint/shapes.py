"""The shapes a ModelConfig implies for the tensors of a GGUF file (llama.cpp's names), checked before any is read."""

from __future__ import annotations

from pathlib import Path

from infero.checkpoint.config import ModelConfig
from infero.checkpoint.gguf import TensorInfo
from infero.errors import ModelFileError


def expected_shape(config: ModelConfig, name: str) -> tuple[int, ...] | None:
    """The shape (outermost first) of the tensor called `name`; None for a name this check does not know."""
    c, d = config, config.hidden_size
    if name.startswith("blk."):
        index, _, name = name[4:].partition(".")
        if not index.isdigit() or int(index) >= c.num_layers:
            return None
        shapes = {"attn_norm.weight": (d,), "attn_q.weight": (c.q_size, d), "attn_k.weight": (c.kv_size, d),
                  "attn_v.weight": (c.kv_size, d), "attn_output.weight": (d, c.q_size), "ffn_norm.weight": (d,),
                  "ffn_gate.weight": (c.intermediate_size, d), "ffn_up.weight": (c.intermediate_size, d),
                  "ffn_down.weight": (d, c.intermediate_size), "attn_q.bias": (c.q_size,),
                  "attn_k.bias": (c.kv_size,), "attn_v.bias": (c.kv_size,), "attn_q_norm.weight": (c.head_dim,),
                  "attn_k_norm.weight": (c.head_dim,)}  # fmt: skip
        if c.is_hybrid:
            shapes |= _hybrid_layer_shapes(c)
    else:
        shapes = {"token_embd.weight": (c.vocab_size, d), "output.weight": (c.vocab_size, d),
                  "output_norm.weight": (d,), "rope_freqs.weight": (c.rope_dim // 2,)}  # fmt: skip
    return shapes.get(name)


def _hybrid_layer_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """A hybrid layer's tensors: the gated attention's q projection holds [q | gate] per head; the delta net's
    q/k/v projection feeds the conv1d's channels; the shared expert's gate is one row (as the converter writes it)."""
    d, v_heads, inner, channels = c.hidden_size, c.ssm_time_step_rank, c.ssm_inner_size, c.conv_channels
    shared = c.shared_expert_intermediate_size
    return {"attn_q.weight": (2 * c.q_size, d), "post_attention_norm.weight": (d,),
            "attn_qkv.weight": (channels, d), "attn_gate.weight": (inner, d),
            "ssm_conv1d.weight": (channels, c.ssm_conv_kernel), "ssm_dt.bias": (v_heads,), "ssm_a": (v_heads,),
            "ssm_beta.weight": (v_heads, d), "ssm_alpha.weight": (v_heads, d), "ssm_ba.weight": (2 * v_heads, d),
            "ssm_norm.weight": (c.linear_v_dim,), "ssm_out.weight": (d, inner),
            "ffn_gate_inp_shexp.weight": (1, d), "ffn_gate_shexp.weight": (shared, d),
            "ffn_up_shexp.weight": (shared, d), "ffn_down_shexp.weight": (d, shared)}  # fmt: skip


def check_tensor_shapes(path: Path, config: ModelConfig, tensors: dict[str, TensorInfo]) -> None:
    """Refuse a file whose tensors do not have the shapes its hyperparameters imply: a mismatch would otherwise
    surface as a broadcasting error in the middle of a forward pass."""
    for name, tensor in tensors.items():
        shape = expected_shape(config, name)
        if shape is not None and tensor.shape != shape:
            raise ModelFileError(
                f"{path}: tensor {name!r} has shape {tensor.shape}, but the file's hyperparameters make it {shape}; "
                "the file is corrupt or was converted wrongly"
            )
