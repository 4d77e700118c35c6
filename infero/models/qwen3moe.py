"""The Qwen3-MoE decoder (GGUF `qwen3moe`): Qwen3's attention, a mixture of SwiGLU experts as its feed-forward.

x = embed(tokens)
for each layer:
    x = x + attention(rmsnorm(x))                         # Qwen3's: q/k norms, NEOX rotary (llama.py)
    h = rmsnorm(x)
    p = softmax(h Wrouter)                                # over all experts
    e_1..e_k = top_k(p)                                   # equal p: the lower expert id first
    w_i = p[e_i] / sum_j p[e_j]
    x = x + sum_i w_i * (silu(h Wgate[e_i]) * h Wup[e_i]) Wdown[e_i]
logits = rmsnorm(x) Wout
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from infero.checkpoint import Checkpoint
from infero.engine.batch import Batch
from infero.errors import ModelFileError
from infero.models.llama import LlamaModel


@dataclass
class MoeLayerWeights:
    attn_norm: Any
    wq: Any
    wk: Any
    wv: Any
    wo: Any
    ffn_norm: Any
    router: Any  # [num_experts, hidden]
    gate_exps: Any  # [num_experts, expert_intermediate_size, hidden]
    up_exps: Any
    down_exps: Any  # [num_experts, hidden, expert_intermediate_size]
    bq: Any = None
    bk: Any = None
    bv: Any = None
    q_norm: Any = None
    k_norm: Any = None


class Qwen3MoeModel(LlamaModel):
    @classmethod
    def load(cls, checkpoint: Checkpoint, ops: Any, progress=None) -> Qwen3MoeModel:
        """Check the expert tensors' shapes against the file's expert keys, then hand every tensor to the backend."""
        check_expert_shapes(checkpoint)
        return super().load(checkpoint, ops, progress)

    layer_weights = MoeLayerWeights

    @staticmethod
    def feed_forward_weights(weight, p: str) -> dict:
        """Layer p's router and expert tensors, by MoeLayerWeights field."""
        return dict(router=weight(p + "ffn_gate_inp.weight"), gate_exps=weight(p + "ffn_gate_exps.weight"),
                    up_exps=weight(p + "ffn_up_exps.weight"), down_exps=weight(p + "ffn_down_exps.weight"))  # fmt: skip

    def forward(self, batch: Batch, cache: Any) -> Any:
        """Logits [len(batch.logits_indices), vocab] for the batch; writes its K/V into the cache."""
        ops, c = self.ops, self.config
        x = ops.embedding(self.embedding, batch.token_ids)
        residual = None
        for i, layer in enumerate(self.layers):
            h, residual = ops.add_rms_norm(x, residual, layer.attn_norm, c.rms_norm_eps)
            attn = self.attention(i, layer, h, batch, cache)
            h, residual = ops.linear_add_rms_norm(attn, layer.wo, residual, layer.ffn_norm, c.rms_norm_eps)
            experts, weights = ops.moe_route(h, layer.router, c.num_experts_used)
            x = ops.moe_experts(h, experts, weights, layer.gate_exps, layer.up_exps, layer.down_exps)
        return self.logits(x, residual, batch)


def check_expert_shapes(checkpoint: Checkpoint) -> None:
    """Refuse a file whose expert tensors disagree with its expert_count / expert_feed_forward_length (they would
    otherwise fail mid-request as an index error, or silently route to experts that are not there)."""
    c, d = checkpoint.config, checkpoint.config.hidden_size
    e, f = c.num_experts, c.expert_intermediate_size
    expected = {"ffn_gate_inp.weight": (e, d), "ffn_gate_exps.weight": (e, f, d), "ffn_up_exps.weight": (e, f, d),
                "ffn_down_exps.weight": (e, d, f)}  # fmt: skip
    for i in range(c.num_layers):
        for suffix, shape in expected.items():
            tensor = checkpoint.tensors.get(f"blk.{i}.{suffix}")
            if tensor is not None and tensor.shape != shape:
                raise ModelFileError(
                    f"{checkpoint.path}: tensor 'blk.{i}.{suffix}' has shape {tensor.shape}, but the file's "
                    f"{c.architecture}.expert_count ({e}), expert_feed_forward_length ({f}) and embedding_length "
                    f"({d}) make it {shape}; the file is corrupt or was converted wrongly"
                )
