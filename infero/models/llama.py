"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3), written once against a backend's ops.

x = embed(tokens)
for each layer:
    h = rmsnorm(x)
    q, k, v = h Wq (+bq), h Wk (+bk), h Wv (+bv)          # Qwen2: biases
    q, k = rmsnorm_per_head(q), rmsnorm_per_head(k)       # Qwen3: q/k norms
    q, k = rotary(q, pos), rotary(k, pos)
    cache[slots] = k, v
    x = x + attention(q, cache, causal) Wo                # grouped-query heads
    x = x + (silu(rmsnorm(x) Wgate) * rmsnorm(x) Wup) Wdown
logits = rmsnorm(x) Wout                                  # Wout = embedding when tied
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from infero.checkpoint import Checkpoint
from infero.checkpoint.config import ModelConfig
from infero.checkpoint.dequantize import dequantize_tensor
from infero.engine.batch import Batch
from infero.errors import ModelFileError
from infero.models.rotary import Rotary, build_rotary


@dataclass
class LayerWeights:
    attn_norm: Any
    wq: Any
    wk: Any
    wv: Any
    wo: Any
    ffn_norm: Any
    w_gate: Any
    w_up: Any
    w_down: Any
    bq: Any = None
    bk: Any = None
    bv: Any = None
    q_norm: Any = None
    k_norm: Any = None


class LlamaModel:
    def __init__(self, config: ModelConfig, ops: Any, embedding: Any, layers: list[LayerWeights], output_norm: Any,
                 output: Any, rotary: Rotary):  # fmt: skip
        self.config, self.ops = config, ops
        self.embedding, self.layers, self.output_norm, self.output = embedding, layers, output_norm, output
        self.rotary = rotary
        self.scale = 1.0 / math.sqrt(config.head_dim)

    layer_weights = LayerWeights
    prefill_alignment = 1  # where the scheduler may end a prompt chunk: anywhere (no op's bits depend on it)

    @staticmethod
    def feed_forward_weights(weight, p: str) -> dict:
        """Layer p's feed-forward tensors, by LayerWeights field."""
        return dict(w_gate=weight(p + "ffn_gate.weight"), w_up=weight(p + "ffn_up.weight"),
                    w_down=weight(p + "ffn_down.weight"))  # fmt: skip

    @classmethod
    def load(cls, checkpoint: Checkpoint, ops: Any, progress=None) -> LlamaModel:
        """Hand every tensor to the backend (which keeps or decodes it) and build the model."""
        weight = weight_loader(checkpoint, ops, progress)
        layers = []
        for i in range(checkpoint.config.num_layers):
            p = f"blk.{i}."
            layers.append(cls.layer_weights(**attention_weights(weight, p), ffn_norm=weight(p + "ffn_norm.weight"),
                                            **cls.feed_forward_weights(weight, p)))  # fmt: skip
        return cls(checkpoint.config, ops, layers=layers, **head_weights(checkpoint, weight))

    def forward(self, batch: Batch, cache: Any) -> Any:
        """Logits [len(batch.logits_indices), vocab] for the batch; writes its K/V into the cache."""
        ops, c = self.ops, self.config
        x = ops.embedding(self.embedding, batch.token_ids)
        h, residual = ops.add_rms_norm(x, None, self.layers[0].attn_norm, c.rms_norm_eps)
        for i, layer in enumerate(self.layers):
            attn = self.attention(i, layer, h, batch, cache)
            # The residual add and the next norm go with the projection before them (the GPU folds them into its
            # launch at decode), so each is told which weights read the normed output.
            gate_up = (layer.w_gate, layer.w_up)
            h, residual = ops.linear_add_rms_norm(attn, layer.wo, residual, layer.ffn_norm, c.rms_norm_eps,
                                                  readers=gate_up)  # fmt: skip
            g = ops.swiglu_gate_up(h, gate_up, reader=layer.w_down)
            if i + 1 < len(self.layers):
                following = self.layers[i + 1]
                h, residual = ops.linear_add_rms_norm(g, layer.w_down, residual, following.attn_norm, c.rms_norm_eps,
                                                      readers=(following.wq, following.wk, following.wv))  # fmt: skip
            else:
                x = ops.linear(g, layer.w_down)
        return self.logits(x, residual, batch)

    def attention(self, i: int, layer: Any, h: Any, batch: Batch, cache: Any) -> Any:
        """Layer i's attention of the normed h over the cache (its K/V written first): [n, q_size], before Wo."""
        ops, c, n = self.ops, self.config, batch.num_tokens
        qkv, biases = (layer.wq, layer.wk, layer.wv), (layer.bq, layer.bk, layer.bv)
        if layer.q_norm is None:  # one op: the GPU folds the rotation and the cache write into the projection
            q = ops.qkv_rotary_store(h, qkv, biases, c.head_dim, batch.positions, self.rotary, cache, i,
                                     batch.slot_mapping)  # fmt: skip
        else:  # Qwen3: per-head q/k norms, then the rotation and the cache write (one op: one GPU launch)
            q, k, v = (y.reshape(n, -1, c.head_dim) for y in ops.linears(h, qkv, biases))
            q = ops.qk_norm_rotary_store_kv(q, k, v, layer.q_norm, layer.k_norm, c.rms_norm_eps, batch.positions,
                                            self.rotary, cache, i, batch.slot_mapping)  # fmt: skip
        return ops.attention(q, cache, i, batch, self.scale).reshape(n, c.q_size)

    def logits(self, x: Any, residual: Any, batch: Batch) -> Any:
        """The output norm of residual + x and the vocabulary projection, for the rows that return logits."""
        ops, rows = self.ops, batch.logits_indices
        x, residual = ops.gather_rows(x, rows), ops.gather_rows(residual, rows)
        h, _ = ops.add_rms_norm(x, residual, self.output_norm, self.config.rms_norm_eps)
        return ops.linear(h, self.output)


def weight_loader(checkpoint: Checkpoint, ops: Any, progress=None):
    """weight(name, optional=False, gathered=False, values=False): the named tensor handed to the backend (gathered:
    an embedding table; values: read elementwise, not as a linear layer's matrix); a missing one is the file's error
    unless optional (then None). A tuple of names: their matrices stacked as one (the rows of each in turn, one
    linear layer's launch for several; a matrix after a 3-D expert tensor is one more expert), or None where they
    differ in type or in their rows' (experts': matrices') shape."""
    config, tensors = checkpoint.config, checkpoint.tensors

    def weight(name: str | tuple[str, ...], optional: bool = False, gathered: bool = False, values: bool = False):
        names = name if isinstance(name, tuple) else (name,)
        for n in names:
            if n not in tensors:
                if optional:
                    return None
                raise ModelFileError(f"{checkpoint.path}: missing tensor {n!r} for a {config.architecture} model")
        parts = [tensors[n] for n in names]
        if len(parts) == 1:
            w = ops.weight(parts[0], gathered=gathered, values=values)
        else:
            # An expert tensor's items are matrices, a matrix's are rows: a matrix joins experts as one more, a
            # vector joins a matrix's rows as one more.
            item = parts[0].shape[1:]
            counts = [t.shape[0] if t.shape[1:] == item else 1 if t.shape == item else 0 for t in parts]
            if len({t.ggml_type for t in parts}) != 1 or len(item) not in (1, 2) or 0 in counts:
                return None
            w = ops.stacked_weight(parts, (sum(counts), *item))
        if progress is not None:
            progress(sum(t.nbytes for t in parts))
        return w

    return weight


def attention_weights(weight, p: str) -> dict[str, Any]:
    """The attention tensors of the layer whose names start with p, as LayerWeights fields."""
    return dict(
        attn_norm=weight(p + "attn_norm.weight"),
        wq=weight(p + "attn_q.weight"),
        wk=weight(p + "attn_k.weight"),
        wv=weight(p + "attn_v.weight"),
        wo=weight(p + "attn_output.weight"),
        bq=weight(p + "attn_q.bias", optional=True),
        bk=weight(p + "attn_k.bias", optional=True),
        bv=weight(p + "attn_v.bias", optional=True),
        q_norm=weight(p + "attn_q_norm.weight", optional=True),
        k_norm=weight(p + "attn_k_norm.weight", optional=True),
    )


def head_weights(checkpoint: Checkpoint, weight) -> dict[str, Any]:
    """The model's ends: embedding, output norm and head (the embedding when tied), rotary frequencies."""
    config, tensors = checkpoint.config, checkpoint.tensors
    embedding = weight("token_embd.weight", gathered=True)  # its rows are looked up by token id
    freq_factors = tensors.get("rope_freqs.weight")
    return dict(
        embedding=embedding,
        output_norm=weight("output_norm.weight"),
        output=embedding if config.tie_word_embeddings else weight("output.weight"),
        rotary=build_rotary(config, None if freq_factors is None else dequantize_tensor(freq_factors)),
    )
