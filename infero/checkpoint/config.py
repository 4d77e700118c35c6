"""ModelConfig: one architecture-neutral description of a decoder, read from GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from infero.errors import ModelFileError, UnsupportedModelError

# Architectures whose GGUF layout the llama-family decoder runs. Mistral-style files use `llama`.
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")

# GGUF `llama` files carry Q/K rows permuted (by the converter) for rotation of adjacent pairs (2i, 2i+1);
# qwen2/qwen3 files are not permuted and rotate dimension i with i + d/2 (GPT-NeoX style).
_ROPE_PAIRING = {"llama": "interleaved", "mistral": "interleaved", "qwen2": "neox", "qwen3": "neox"}


@dataclass(frozen=True)
class RopeScaling:
    """Context-extension scaling of rotary frequencies, as llama.cpp reads it from `{arch}.rope.scaling.*`."""

    kind: str = "none"  # none | linear | yarn
    factor: float = 1.0
    original_context_length: int = 0
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_log_multiplier: float = 0.1


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_dim: int
    rope_theta: float
    rope_pairing: str  # interleaved | neox
    rope_scaling: RopeScaling
    rms_norm_eps: float
    context_length: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ModelFileError(f"{self.num_heads} attention heads are not a multiple of {self.num_kv_heads} KV heads")
        if self.rope_dim > self.head_dim or self.rope_dim % 2:
            raise ModelFileError(f"rotary dimension {self.rope_dim} does not fit head dimension {self.head_dim}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_gguf(cls, metadata: dict[str, Any], tensor_names: set[str]) -> ModelConfig:
        arch = metadata.get("general.architecture")
        if arch is None:
            raise ModelFileError("GGUF file has no general.architecture: not a model file")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )

        def get(key: str, default: Any = None) -> Any:
            value = metadata.get(f"{arch}.{key}", default)
            if value is None:
                raise ModelFileError(f"GGUF metadata lacks {arch}.{key}")
            return value

        hidden = int(get("embedding_length"))
        num_heads = int(get("attention.head_count"))
        num_kv_heads = get("attention.head_count_kv", num_heads)
        if not isinstance(num_kv_heads, int):  # per-layer arrays exist in some files; the decoder needs one value
            values = {int(v) for v in num_kv_heads}
            if len(values) != 1:
                raise UnsupportedModelError(f"per-layer KV head counts {sorted(values)} are not supported")
            num_kv_heads = values.pop()
        head_dim = int(get("attention.key_length", hidden // num_heads))
        if int(get("attention.value_length", head_dim)) != head_dim:
            raise UnsupportedModelError("different key and value head dimensions are not supported")
        tokens = metadata.get("tokenizer.ggml.tokens")
        vocab_size = int(metadata.get(f"{arch}.vocab_size", len(tokens) if tokens is not None else 0))
        if "token_embd.weight" not in tensor_names:
            raise ModelFileError("GGUF file has no token_embd.weight tensor")
        return cls(
            architecture=arch,
            name=str(metadata.get("general.name", arch)),
            vocab_size=vocab_size,
            hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length")),
            num_layers=int(get("block_count")),
            num_heads=num_heads,
            num_kv_heads=int(num_kv_heads),
            head_dim=head_dim,
            rope_dim=int(get("rope.dimension_count", head_dim)),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rope_pairing=_ROPE_PAIRING[arch],
            rope_scaling=_rope_scaling(metadata, arch),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
            context_length=int(get("context_length", 4096)),
            tie_word_embeddings="output.weight" not in tensor_names,
            attention_bias="blk.0.attn_q.bias" in tensor_names,
            qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        )


def _rope_scaling(metadata: dict[str, Any], arch: str) -> RopeScaling:
    kind = metadata.get(f"{arch}.rope.scaling.type", "none")
    factor = float(metadata.get(f"{arch}.rope.scaling.factor", 1.0))
    if kind == "none" or factor == 1.0:
        # Older files only carry the linear factor.
        linear = metadata.get(f"{arch}.rope.scale_linear")
        if linear is not None and float(linear) != 1.0:
            return RopeScaling(kind="linear", factor=float(linear))
        return RopeScaling()
    if kind not in ("linear", "yarn"):
        raise UnsupportedModelError(f"rope scaling type {kind!r} is not supported (linear and yarn are)")
    return RopeScaling(
        kind=kind,
        factor=factor,
        original_context_length=int(metadata.get(f"{arch}.rope.scaling.original_context_length", 0)),
        yarn_beta_fast=float(metadata.get(f"{arch}.rope.scaling.yarn_beta_fast", 32.0)),
        yarn_beta_slow=float(metadata.get(f"{arch}.rope.scaling.yarn_beta_slow", 1.0)),
        yarn_log_multiplier=float(metadata.get(f"{arch}.rope.scaling.yarn_log_multiplier", 0.1)),
    )
