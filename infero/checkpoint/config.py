"""ModelConfig: one architecture-neutral description of a decoder, read from GGUF metadata."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from infero.errors import ModelFileError, UnsupportedModelError, excerpt

# Architectures whose GGUF layout the llama-family decoder runs. Mistral-style files use `llama`.
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "qwen3moe", "qwen35", "qwen35moe", "qwen3next")
# Architectures whose feed-forward is a mixture of experts (`{arch}.expert_*` keys, `ffn_*_exps` tensors).
MOE_ARCHITECTURES = ("qwen3moe", "qwen35moe", "qwen3next")
# Hybrids of Gated DeltaNet layers (a recurrent state per sequence, `{arch}.ssm.*` keys) and gated full attention.
HYBRID_ARCHITECTURES = ("qwen35", "qwen35moe", "qwen3next")

# GGUF `llama` files carry Q/K rows permuted (by the converter) for rotation of adjacent pairs (2i, 2i+1);
# qwen2/qwen3 files are not permuted and rotate dimension i with i + d/2 (GPT-NeoX style).
_ROPE_PAIRING = {"llama": "interleaved", "mistral": "interleaved", "qwen2": "neox", "qwen3": "neox",
                 "qwen3moe": "neox", "qwen35": "neox", "qwen35moe": "neox", "qwen3next": "neox"}  # fmt: skip

MAX_HEAD_DIM = 1024  # released models use 64-256; a larger value is a corrupt field, not a model
MAX_TOKENS = 2**31 - 1  # token ids and positions are int32
MAX_EXPERTS = 4096  # released models use 8-512; more is a corrupt field
MAX_CONV_KERNEL = 64  # released delta nets use 4; the conv state keeps kernel - 1 inputs per channel
_BROKEN = "the file is corrupt or was converted wrongly"
_MISSING = object()


@dataclass(frozen=True)
class RopeScaling:
    """Context-extension scaling of rotary frequencies, as llama.cpp reads it from `{arch}.rope.scaling.*`."""

    kind: str = "none"  # none | linear | yarn
    factor: float = 1.0
    original_context_length: int = 0
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_log_multiplier: float = 0.1

    def __post_init__(self):
        for name in ("factor", "yarn_beta_fast", "yarn_beta_slow"):
            value = getattr(self, name)
            _require(math.isfinite(value) and value > 0, f"rope.scaling.{name}", value, "a finite number > 0")
        multiplier = self.yarn_log_multiplier
        _require(math.isfinite(multiplier), "rope.scaling.yarn_log_multiplier", multiplier, "a finite number")
        length = self.original_context_length
        _require(0 <= length <= MAX_TOKENS, "rope.scaling.original_context_length", length, f"from 0 to {MAX_TOKENS:,}")


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
    num_experts: int = 0  # 0: a dense feed-forward
    num_experts_used: int = 0  # experts each token is routed to
    expert_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    # Hybrid models: per layer True for a Gated DeltaNet layer, False for full attention; None for the others.
    recurrent_layers: tuple[bool, ...] | None = None
    ssm_conv_kernel: int = 0  # causal depthwise conv1d taps over the q/k/v channels
    ssm_state_size: int = 0  # delta net key head dimension d_k
    ssm_group_count: int = 0  # delta net key (and query) heads
    ssm_time_step_rank: int = 0  # delta net value heads (one gate and decay each)
    ssm_inner_size: int = 0  # value heads * value head dimension d_v
    # M-RoPE sections (rotated pairs per position axis); for text every axis holds the token's position, so they
    # change nothing here; kept for the vision model.
    rope_sections: tuple[int, ...] = ()

    def __post_init__(self):
        """Refuse hyperparameters no model can run with (a zero head count, a negative epsilon, a NaN rotary base):
        they would fail later as a division by zero, or as NaN logits on every request."""
        sizes = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                 "context_length")  # fmt: skip
        for name in sizes:
            _require(
                0 < getattr(self, name) <= MAX_TOKENS,
                self._key(name),
                getattr(self, name),
                f"an integer from 1 to {MAX_TOKENS:,}",
            )
        _require(self.num_heads % self.num_kv_heads == 0, self._key("num_kv_heads"), self.num_kv_heads,
                 f"a divisor of the {self.num_heads} attention heads")  # fmt: skip
        _require(0 < self.head_dim <= MAX_HEAD_DIM and self.head_dim % 2 == 0, self._key("head_dim"), self.head_dim,
                 f"an even number from 2 to {MAX_HEAD_DIM}")  # fmt: skip
        _require(0 < self.rope_dim <= self.head_dim and self.rope_dim % 2 == 0, self._key("rope_dim"), self.rope_dim,
                 f"an even number from 2 to the head dimension {self.head_dim}")  # fmt: skip
        # A base <= 1 makes no rotary sense (released models use 10,000 to 1,000,000) and YaRN divides by log(base).
        _require(math.isfinite(self.rope_theta) and self.rope_theta > 1, self._key("rope_theta"), self.rope_theta,
                 "a finite number > 1")  # fmt: skip
        _require(math.isfinite(self.rms_norm_eps) and 0 < self.rms_norm_eps < 1, self._key("rms_norm_eps"),
                 self.rms_norm_eps, "a number > 0 and < 1 (typically 1e-5 or 1e-6)")  # fmt: skip
        if self.architecture in MOE_ARCHITECTURES:
            self._check_experts()
        if self.architecture in HYBRID_ARCHITECTURES:
            self._check_delta_net()

    def _check_delta_net(self) -> None:
        layers = self.recurrent_layers
        if layers is None or len(layers) != self.num_layers:
            count = "none" if layers is None else f"{len(layers)} entries"
            raise ModelFileError(
                f"GGUF metadata {self.architecture}.attention.recurrent_layers has {count}, but the model has "
                f"{self.num_layers} layers ({self._key('num_layers')}); {_BROKEN}"
            )
        if all(layers):  # the KV cache is sized in blocks of the attention layers' K/V: there would be none
            raise UnsupportedModelError(
                f"{self.architecture}.attention.recurrent_layers makes every layer a Gated DeltaNet layer; infero "
                "runs hybrids with at least one attention layer"
            )
        _require(0 < self.ssm_conv_kernel <= MAX_CONV_KERNEL, self._key("ssm_conv_kernel"), self.ssm_conv_kernel,
                 f"an integer from 1 to {MAX_CONV_KERNEL}")  # fmt: skip
        _require(0 < self.ssm_state_size <= MAX_HEAD_DIM, self._key("ssm_state_size"), self.ssm_state_size,
                 f"an integer from 1 to {MAX_HEAD_DIM}")  # fmt: skip
        _require(0 < self.ssm_group_count <= MAX_TOKENS, self._key("ssm_group_count"), self.ssm_group_count,
                 f"an integer from 1 to {MAX_TOKENS:,}")  # fmt: skip
        _require(0 < self.ssm_time_step_rank <= MAX_TOKENS and self.ssm_time_step_rank % self.ssm_group_count == 0,
                 self._key("ssm_time_step_rank"), self.ssm_time_step_rank,
                 f"a multiple of the {self.ssm_group_count} key heads (ssm.group_count)")  # fmt: skip
        v_heads = self.ssm_time_step_rank
        inner = self.ssm_inner_size
        _require(0 < inner <= MAX_TOKENS and inner % v_heads == 0 and inner // v_heads <= MAX_HEAD_DIM,
                 self._key("ssm_inner_size"), inner,
                 f"the {v_heads} value heads times a head dimension from 1 to {MAX_HEAD_DIM}")  # fmt: skip

    def _check_experts(self) -> None:
        _require(0 < self.num_experts <= MAX_EXPERTS, self._key("num_experts"), self.num_experts,
                 f"an integer from 1 to {MAX_EXPERTS:,}")  # fmt: skip
        _require(0 < self.num_experts_used <= self.num_experts, self._key("num_experts_used"),
                 self.num_experts_used, f"an integer from 1 to the {self.num_experts} experts")  # fmt: skip
        _require(0 < self.expert_intermediate_size <= MAX_TOKENS, self._key("expert_intermediate_size"),
                 self.expert_intermediate_size, f"an integer from 1 to {MAX_TOKENS:,}")  # fmt: skip

    def _key(self, name: str) -> str:
        return f"{self.architecture}.{_KEYS[name]}"

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def is_hybrid(self) -> bool:
        return self.recurrent_layers is not None

    @property
    def num_recurrent_layers(self) -> int:
        return sum(self.recurrent_layers or ())

    @property
    def linear_v_dim(self) -> int:
        """A delta net value head's dimension d_v."""
        return self.ssm_inner_size // self.ssm_time_step_rank

    @property
    def conv_channels(self) -> int:
        """The channels the delta net's conv1d runs over: q and k (key heads x d_k each), then v (inner size)."""
        return 2 * self.ssm_group_count * self.ssm_state_size + self.ssm_inner_size

    @classmethod
    def from_gguf(cls, metadata: dict[str, Any], tensor_names: set[str]) -> ModelConfig:
        arch = metadata.get("general.architecture")
        if arch is None:
            raise ModelFileError("GGUF file has no general.architecture: not a model file")
        if not isinstance(arch, str) or arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"architecture {excerpt(arch)} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )

        def get(key: str, kind: type, default: Any = _MISSING) -> Any:
            return _typed(metadata, f"{arch}.{key}", kind, default)

        hidden = get("embedding_length", int)
        num_heads = get("attention.head_count", int)
        _require(num_heads > 0, f"{arch}.attention.head_count", num_heads, "an integer > 0")
        head_dim = get("attention.key_length", int, hidden // num_heads)
        if get("attention.value_length", int, head_dim) != head_dim:
            raise UnsupportedModelError("different key and value head dimensions are not supported")
        tokens = metadata.get("tokenizer.ggml.tokens")
        vocab_size = get("vocab_size", int, len(tokens) if isinstance(tokens, list) else 0)
        if isinstance(tokens, list) and len(tokens) > vocab_size:
            raise ModelFileError(f"the tokenizer has {len(tokens):,} tokens but {arch}.vocab_size is {vocab_size:,}: "
                                 f"its ids would index past the embedding; {_BROKEN}")  # fmt: skip
        if "token_embd.weight" not in tensor_names:
            raise ModelFileError("GGUF file has no token_embd.weight tensor")
        return cls(
            architecture=arch,
            name=str(metadata.get("general.name", arch)),
            vocab_size=vocab_size,
            hidden_size=hidden,
            intermediate_size=get("feed_forward_length", int, *_dense_width_default(metadata, arch)),
            num_layers=get("block_count", int) - _draft_layers(metadata, arch),
            num_heads=num_heads,
            num_kv_heads=_kv_heads(metadata.get(f"{arch}.attention.head_count_kv", num_heads)),
            head_dim=head_dim,
            rope_dim=get("rope.dimension_count", int, head_dim),
            rope_theta=get("rope.freq_base", float, 10000.0),
            rope_pairing=_ROPE_PAIRING[arch],
            rope_scaling=_rope_scaling(metadata, arch),
            rms_norm_eps=get("attention.layer_norm_rms_epsilon", float, 1e-5),
            context_length=get("context_length", int, 4096),
            tie_word_embeddings="output.weight" not in tensor_names,
            attention_bias="blk.0.attn_q.bias" in tensor_names,
            qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
            **(_experts(metadata, arch) if arch in MOE_ARCHITECTURES else {}),
            **(_delta_net(metadata, arch) if arch in HYBRID_ARCHITECTURES else {}),
        )


def _experts(metadata: dict[str, Any], arch: str) -> dict[str, int]:
    """The mixture-of-experts keys as ModelConfig fields. No key says whether the top-k weights are renormalized:
    llama.cpp's converter writes none for qwen3moe and its runtime always renormalizes (as transformers does with
    the published models' norm_topk_prob = true), so the model always does."""
    return {
        "num_experts": _typed(metadata, f"{arch}.expert_count", int),
        "num_experts_used": _typed(metadata, f"{arch}.expert_used_count", int),
        "expert_intermediate_size": _typed(metadata, f"{arch}.expert_feed_forward_length", int),
    }


def _dense_width_default(metadata: dict[str, Any], arch: str) -> tuple[Any, ...]:
    """feed_forward_length's default: none (it is required), except for a hybrid MoE model, whose converted file
    may lack it (Qwen3.5-MoE's config has no dense width): the expert width stands in, as nothing dense uses it."""
    if arch in HYBRID_ARCHITECTURES and arch in MOE_ARCHITECTURES:
        return (metadata.get(f"{arch}.expert_feed_forward_length", _MISSING),)
    return ()


def _draft_layers(metadata: dict[str, Any], arch: str) -> int:
    """Layers after the text model's: a Qwen3.5 file converted with its multi-token-prediction block holds it as
    the last of block_count layers (nextn_predict_layers says how many); llama.cpp's text model skips them, and
    so does infero (nothing here drafts tokens)."""
    if arch not in HYBRID_ARCHITECTURES:
        return 0
    return _typed(metadata, f"{arch}.nextn_predict_layers", int, 0)


def _delta_net(metadata: dict[str, Any], arch: str) -> dict[str, Any]:
    """The hybrid keys as ModelConfig fields. Layer kinds come from attention.recurrent_layers (an entry for each
    of block_count layers, the text model's first), or else (older files) from full_attention_interval: every
    interval-th layer is full attention, as llama.cpp reads them."""
    layers = metadata.get(f"{arch}.attention.recurrent_layers")
    count = _typed(metadata, f"{arch}.block_count", int)
    text_layers = count - _draft_layers(metadata, arch)
    if layers is None:
        interval = _typed(metadata, f"{arch}.full_attention_interval", int, 4)
        _require(interval > 0, f"{arch}.full_attention_interval", interval, "an integer > 0")
        layer_kinds = tuple((i + 1) % interval != 0 for i in range(max(0, min(text_layers, MAX_TOKENS))))
    elif isinstance(layers, np.ndarray) and layers.ndim == 1 and layers.dtype.kind in "biu":
        if len(layers) != count:
            raise ModelFileError(f"GGUF metadata {arch}.attention.recurrent_layers has {len(layers)} entries, but "
                                 f"{arch}.block_count is {count}; {_BROKEN}")  # fmt: skip
        layer_kinds = tuple(bool(v) for v in layers[: max(0, text_layers)])
    else:
        raise ModelFileError(f"GGUF metadata {arch}.attention.recurrent_layers must be an array of booleans; the "
                             f"file holds {excerpt(layers)} ({_BROKEN})")  # fmt: skip
    sections = metadata.get(f"{arch}.rope.dimension_sections", ())
    fields: dict[str, Any] = {
        "recurrent_layers": layer_kinds,
        "ssm_conv_kernel": _typed(metadata, f"{arch}.ssm.conv_kernel", int),
        "ssm_state_size": _typed(metadata, f"{arch}.ssm.state_size", int),
        "ssm_group_count": _typed(metadata, f"{arch}.ssm.group_count", int),
        "ssm_time_step_rank": _typed(metadata, f"{arch}.ssm.time_step_rank", int),
        "ssm_inner_size": _typed(metadata, f"{arch}.ssm.inner_size", int),
        "rope_sections": tuple(int(v) for v in sections) if isinstance(sections, np.ndarray) else (),
    }
    if arch in MOE_ARCHITECTURES:
        shared = _typed(metadata, f"{arch}.expert_shared_feed_forward_length", int, 0)
        fields["shared_expert_intermediate_size"] = shared
    return fields


def _rope_scaling(metadata: dict[str, Any], arch: str) -> RopeScaling:
    prefix = f"{arch}.rope.scaling."
    kind = metadata.get(prefix + "type", "none")
    factor = _typed(metadata, prefix + "factor", float, 1.0)
    if kind == "none" or factor == 1.0:
        # Older files only carry the linear factor.
        linear = _typed(metadata, f"{arch}.rope.scale_linear", float, 1.0)
        return RopeScaling(kind="linear", factor=linear) if linear != 1.0 else RopeScaling()
    if kind not in ("linear", "yarn"):
        raise UnsupportedModelError(f"rope scaling type {excerpt(kind)} is not supported (linear and yarn are)")
    return RopeScaling(
        kind=kind,
        factor=factor,
        original_context_length=_typed(metadata, prefix + "original_context_length", int, 0),
        yarn_beta_fast=_typed(metadata, prefix + "yarn_beta_fast", float, 32.0),
        yarn_beta_slow=_typed(metadata, prefix + "yarn_beta_slow", float, 1.0),
        yarn_log_multiplier=_typed(metadata, prefix + "yarn_log_multiplier", float, 0.1),
    )


def _typed(metadata: dict[str, Any], key: str, kind: type, default: Any = _MISSING) -> Any:
    """metadata[key] as an int or a float (an integer is a number too); a missing key without a default, or a
    value of another type (a string, an array, a bool), is the file's error."""
    value = metadata.get(key, default)
    if value is _MISSING:
        raise ModelFileError(f"GGUF metadata lacks {key}; {_BROKEN}")
    numeric = (int,) if kind is int else (int, float)
    if not isinstance(value, numeric) or isinstance(value, bool):
        noun = "an integer" if kind is int else "a number"
        raise ModelFileError(f"GGUF metadata {key} must be {noun}; the file holds {excerpt(value)} ({_BROKEN})")
    return kind(value)


def _kv_heads(value: Any) -> int:
    """attention.head_count_kv: one integer, or a per-layer array (some files) whose entries must all agree."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if not isinstance(value, np.ndarray) or value.dtype.kind not in "iu" or value.size == 0:
        raise ModelFileError(f"GGUF metadata attention.head_count_kv must be an integer; the file holds "
                             f"{excerpt(value)} ({_BROKEN})")  # fmt: skip
    values = sorted({int(v) for v in value})
    if len(values) != 1:
        raise UnsupportedModelError(f"per-layer KV head counts {excerpt(values)} are not supported")
    return values[0]


def _require(ok: bool, key: str, value: Any, rule: str) -> None:
    if not ok:
        raise ModelFileError(f"GGUF metadata {key} = {excerpt(value)} is invalid: it must be {rule}; {_BROKEN}")


# ModelConfig field -> the GGUF key (after `{arch}.`) it comes from, for error messages.
_KEYS = {
    "vocab_size": "vocab_size (or the number of tokenizer.ggml.tokens)",
    "hidden_size": "embedding_length",
    "intermediate_size": "feed_forward_length",
    "num_layers": "block_count",
    "num_heads": "attention.head_count",
    "num_kv_heads": "attention.head_count_kv",
    "head_dim": "attention.key_length (or embedding_length / attention.head_count)",
    "rope_dim": "rope.dimension_count",
    "rope_theta": "rope.freq_base",
    "rms_norm_eps": "attention.layer_norm_rms_epsilon",
    "context_length": "context_length",
    "num_experts": "expert_count",
    "num_experts_used": "expert_used_count",
    "expert_intermediate_size": "expert_feed_forward_length",
    "ssm_conv_kernel": "ssm.conv_kernel",
    "ssm_state_size": "ssm.state_size",
    "ssm_group_count": "ssm.group_count",
    "ssm_time_step_rank": "ssm.time_step_rank",
    "ssm_inner_size": "ssm.inner_size",
}
