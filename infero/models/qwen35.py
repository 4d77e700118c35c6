"""The Qwen3.5 / Qwen3-Next hybrid decoder (GGUF `qwen35`, `qwen35moe`, `qwen3next`): Gated DeltaNet layers with
a gated full-attention layer between them (`recurrent_layers`, typically three of every four are delta nets).

x = embed(tokens)
for each layer:
    h = rmsnorm(x)
    if a Gated DeltaNet layer:                                         # one state (conv, S) per sequence
        qkv, z = h Wqkv, h Wz
        g, beta = a * softplus(h Walpha + dt_bias), sigmoid(h Wbeta)   # a = -exp(A_log) < 0
        q, k, v = silu(causal_conv1d(qkv))                              # kernel 4: carries the last 3 inputs
        q, k = l2norm(q) / sqrt(d_k), l2norm(k)                        # per key head, shared by value heads
        for each token: S <- S exp(g); S <- S + beta k (v - S^T k)^T; o = S^T q
        a = (rmsnorm(o) * w * silu(z)) Wout
    else:                                                              # gated attention over the paged KV cache
        q | gate = h Wq (per head); k, v = h Wk, h Wv
        q, k = rotary(rmsnorm(q)), rotary(rmsnorm(k))                  # the first rope_dim dims, NEOX pairs
        a = (attention(q, k, v) * sigmoid(gate)) Wo
    x = x + a
    h = rmsnorm(x)
    x = x + SwiGLU(h)                                                  # qwen35
          | sum_i w_i SwiGLU_e_i(h) + sigmoid(h w_shared) SwiGLU_shared(h)   # qwen35moe, qwen3next
logits = rmsnorm(x) Wout

The file's norms hold 1 + w already (the converter adds it), except the delta net's gated norm. Value heads: in
qwen35/qwen35moe files the converter reorders them so value head j uses key head j mod (key heads) ("tiled");
qwen3next files keep transformers' order, where value head j uses key head j // (value heads per key head).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from infero.checkpoint import Checkpoint
from infero.checkpoint.config import MOE_ARCHITECTURES
from infero.engine.batch import Batch
from infero.errors import ModelFileError
from infero.models.llama import LlamaModel, head_weights, weight_loader
from infero.models.qwen3moe import check_expert_shapes


@dataclass
class DeltaNetWeights:
    qkv: Any  # [conv channels, hidden]: q (key heads x d_k), k (same), v (value heads x d_v)
    gate: Any  # z [value heads x d_v, hidden]
    # alpha and beta [value heads, hidden] as one matrix: qwen35's alpha rows then beta rows, stacked at load where
    # they share a type (one launch for both), or qwen3next's ssm_ba, per key head [its betas | its alphas]; None
    # where alpha and beta stay apart.
    alpha_beta: Any
    alpha: Any
    beta: Any
    conv: Any  # [conv channels, kernel]
    dt_bias: Any  # [value heads]
    a: Any  # [value heads]: -exp(A_log)
    norm: Any  # [d_v]
    out: Any  # [hidden, value heads x d_v]


@dataclass
class GatedAttentionWeights:
    wq: Any  # [heads x 2 head_dim, hidden]: per head, its query then its output gate
    wk: Any
    wv: Any
    q_norm: Any
    k_norm: Any
    out: Any  # [hidden, heads x head_dim]


@dataclass
class HybridLayer:
    attn_norm: Any
    mixer: DeltaNetWeights | GatedAttentionWeights
    ffn_norm: Any
    ffn: dict[str, Any]  # w_gate, w_up, w_down; MoE: router, *_exps, and the shared expert's *_shexp, shexp_gate


class Qwen35Model(LlamaModel):
    # The backends' delta rule takes whole 64-position chunks (from the sequence's start) in its chunked form and
    # the other tokens one by one, so prompt chunks that end on those multiples give a prompt the same bits
    # however the scheduler splits it (docs/kernels.md, batch invariance rule 4).
    prefill_alignment = 64

    @classmethod
    def load(cls, checkpoint: Checkpoint, ops: Any, progress=None) -> Qwen35Model:
        c = checkpoint.config
        check_layer_kinds(checkpoint)
        if c.architecture in MOE_ARCHITECTURES:
            check_expert_shapes(checkpoint)
        weight = weight_loader(checkpoint, ops, progress)
        moe = c.architecture in MOE_ARCHITECTURES
        layers = []
        for i, recurrent in enumerate(c.recurrent_layers):
            p = f"blk.{i}."
            mixer = delta_net_weights(weight, p, c) if recurrent else gated_attention_weights(weight, p)
            ffn = moe_weights(weight, p, checkpoint.tensors) if moe else dense_weights(weight, p)
            layers.append(HybridLayer(attn_norm=weight(p + "attn_norm.weight"), mixer=mixer,
                                      ffn_norm=weight(p + "post_attention_norm.weight"), ffn=ffn))  # fmt: skip
        return cls(c, ops, layers=layers, **head_weights(checkpoint, weight))

    def __init__(self, config, ops, embedding, layers, output_norm, output, rotary):
        super().__init__(config, ops, embedding, layers, output_norm, output, rotary)
        # Which key head a value head reads: qwen35 files hold the value heads reordered (h % key heads), qwen3next
        # files in transformers' order (h // (value heads / key heads)).
        self.pairing = "grouped" if config.architecture == "qwen3next" else "tiled"
        # Layer i's index among the layers of its kind: the cache keeps KV blocks and states per kind.
        kinds = config.recurrent_layers
        self.cache_index = [sum(1 for k in kinds[:i] if k == kinds[i]) for i in range(len(kinds))]

    def forward(self, batch: Batch, cache: Any) -> Any:
        """Logits [len(batch.logits_indices), vocab]; writes K/V and each sequence's recurrent state."""
        ops, c = self.ops, self.config
        ops.reset_fresh_states(cache, batch)
        x = ops.embedding(self.embedding, batch.token_ids)
        residual = None
        for i, layer in enumerate(self.layers):
            h, residual = ops.add_rms_norm(x, residual, layer.attn_norm, c.rms_norm_eps)
            if isinstance(layer.mixer, DeltaNetWeights):
                mixed = self.delta_net(self.cache_index[i], layer.mixer, h, batch, cache)
            else:
                mixed = self.gated_attention(self.cache_index[i], layer.mixer, h, batch, cache)
            h, residual = ops.linear_add_rms_norm(mixed, layer.mixer.out, residual, layer.ffn_norm, c.rms_norm_eps)
            x = self.feed_forward(layer.ffn, h)
        return self.logits(x, residual, batch)

    def delta_net(self, index: int, w: DeltaNetWeights, h: Any, batch: Batch, cache: Any) -> Any:
        """Recurrent layer `index`'s Gated DeltaNet of the normed h: [n, value heads x d_v], before Wout."""
        ops, c, n = self.ops, self.config, batch.num_tokens
        k_heads, d_k, v_heads, d_v = c.ssm_group_count, c.ssm_state_size, c.ssm_time_step_rank, c.linear_v_dim
        qkv, z = ops.linears(h, (w.qkv, w.gate))
        alpha, beta, group = self.gate_projections(w, h)
        # silu(conv1d) of q | k | v with q and k l2-normed, and the gates, in one op. The l2 norm's eps: the file's
        # RMS eps, as llama.cpp reads it (transformers hard-codes 1e-6, which is the published models' RMS eps too).
        qkv, g, beta = ops.delta_net_inputs(qkv, alpha, beta, w.conv, w.dt_bias, w.a, k_heads, d_k, c.rms_norm_eps,
                                            cache, index, batch, group)  # fmt: skip
        key_size = k_heads * d_k
        q, k = ops.columns(qkv, 0, key_size), ops.columns(qkv, key_size, 2 * key_size)
        v = ops.columns(qkv, 2 * key_size, 2 * key_size + v_heads * d_v)
        o = ops.gated_delta_rule(q, k, v, g, beta, self.pairing, 1.0 / math.sqrt(d_k), cache, index, batch)
        return ops.gated_rms_norm(o, w.norm, z, c.rms_norm_eps).reshape(n, -1)

    def gate_projections(self, w: DeltaNetWeights, h: Any) -> tuple[Any, Any, int | None]:
        """(alpha, beta, group) of the normed h for delta_net_inputs: alpha and beta [n, value heads], columns of
        one stacked projection or two; qwen3next's ba as beta with alpha None and group the value heads per key
        head (ba holds per key head its `group` betas, then its alphas)."""
        ops, c = self.ops, self.config
        v_heads = c.ssm_time_step_rank
        if c.architecture == "qwen3next":
            return None, ops.linear(h, w.alpha_beta), v_heads // c.ssm_group_count
        if w.alpha_beta is not None:
            ab = ops.linear(h, w.alpha_beta)
            return ops.columns(ab, 0, v_heads), ops.columns(ab, v_heads, 2 * v_heads), None
        alpha, beta = ops.linears(h, (w.alpha, w.beta))
        return alpha, beta, None

    def gated_attention(self, index: int, w: GatedAttentionWeights, h: Any, batch: Batch, cache: Any) -> Any:
        """Attention layer `index`'s gated attention of the normed h over the cache: [n, q_size], before Wo."""
        ops, c, n = self.ops, self.config, batch.num_tokens
        q_gate, k, v = ops.linears(h, (w.wq, w.wk, w.wv))
        q_gate = q_gate.reshape(n, c.num_heads, 2 * c.head_dim)
        k, v = (y.reshape(n, c.num_kv_heads, c.head_dim) for y in (k, v))
        q = ops.qk_norm_rotary_store_kv(ops.columns(q_gate, 0, c.head_dim), k, v, w.q_norm, w.k_norm,
                                        c.rms_norm_eps, batch.positions, self.rotary, cache, index,
                                        batch.slot_mapping)  # fmt: skip
        attn = ops.attention(q, cache, index, batch, self.scale)
        return ops.sigmoid_gate(attn, ops.columns(q_gate, c.head_dim, 2 * c.head_dim)).reshape(n, c.q_size)

    def feed_forward(self, w: dict[str, Any], h: Any) -> Any:
        """The dense SwiGLU, or the routed experts plus the sigmoid-gated shared expert: folded in as one more
        expert (its gate one more router row, moe_route's `shared`) where its matrices are the experts' type and
        shape, which takes three launches fewer a layer on the GPU."""
        ops, c = self.ops, self.config
        if "router" not in w:
            return ops.linear(ops.swiglu_gate_up(h, (w["w_gate"], w["w_up"]), reader=w["w_down"]), w["w_down"])
        if "shexp_gate" not in w:
            experts, weights = ops.moe_route(h, w["router"], c.num_experts_used, shared=True)
            return ops.moe_experts(h, experts, weights, w["gate_exps"], w["up_exps"], w["down_exps"])
        experts, weights = ops.moe_route(h, w["router"], c.num_experts_used)
        routed = ops.moe_experts(h, experts, weights, w["gate_exps"], w["up_exps"], w["down_exps"])
        shared_h = ops.swiglu_gate_up(h, (w["gate_shexp"], w["up_shexp"]), reader=w["down_shexp"])
        shared = ops.linear(shared_h, w["down_shexp"])
        return ops.sigmoid_gate(shared, ops.linear(h, w["shexp_gate"]), addend=routed)


def check_layer_kinds(checkpoint: Checkpoint) -> None:
    """Refuse layer kinds that the file's tensors contradict (a delta-net layer holding attention tensors, or the
    reverse): the metadata is what is wrong then, not a tensor that went missing."""
    c = checkpoint.config
    for i, recurrent in enumerate(c.recurrent_layers):
        mine, theirs = ("ssm_a", "attn_q.weight") if recurrent else ("attn_q.weight", "ssm_a")
        if f"blk.{i}.{mine}" not in checkpoint.tensors and f"blk.{i}.{theirs}" in checkpoint.tensors:
            kind, other = ("a Gated DeltaNet", "attention") if recurrent else ("an attention", "Gated DeltaNet")
            raise ModelFileError(
                f"{checkpoint.path}: {c.architecture}.attention.recurrent_layers makes layer {i} {kind} layer, but "
                f"the file holds {other} tensors there ('blk.{i}.{theirs}'); the file is corrupt or was converted "
                "wrongly"
            )


def delta_net_weights(weight, p: str, config) -> DeltaNetWeights:
    """Layer p's Gated DeltaNet tensors; qwen3next files hold beta and alpha in one projection (ssm_ba)."""
    alpha = beta = None
    if config.architecture == "qwen3next":
        alpha_beta = weight(p + "ssm_ba.weight")
    else:
        alpha_beta = weight((p + "ssm_alpha.weight", p + "ssm_beta.weight"))
        if alpha_beta is None:
            alpha, beta = weight(p + "ssm_alpha.weight"), weight(p + "ssm_beta.weight")
    return DeltaNetWeights(qkv=weight(p + "attn_qkv.weight"), gate=weight(p + "attn_gate.weight"),
                           alpha_beta=alpha_beta, alpha=alpha, beta=beta,
                           conv=weight(p + "ssm_conv1d.weight", values=True),
                           dt_bias=weight(p + "ssm_dt.bias"), a=weight(p + "ssm_a"),
                           norm=weight(p + "ssm_norm.weight"), out=weight(p + "ssm_out.weight"))  # fmt: skip


def gated_attention_weights(weight, p: str) -> GatedAttentionWeights:
    return GatedAttentionWeights(
        wq=weight(p + "attn_q.weight"),
        wk=weight(p + "attn_k.weight"),
        wv=weight(p + "attn_v.weight"),
        q_norm=weight(p + "attn_q_norm.weight"),
        k_norm=weight(p + "attn_k_norm.weight"),
        out=weight(p + "attn_output.weight"),
    )


def dense_weights(weight, p: str) -> dict[str, Any]:
    return {name: weight(f"{p}ffn_{name[2:]}.weight") for name in ("w_gate", "w_up", "w_down")}


def moe_weights(weight, p: str, tensors) -> dict[str, Any]:
    """The router and experts; the shared expert as expert number `experts` of the stacked expert tensors, and its
    gate as the router's last row, where each of its matrices has its expert tensor's type and matrix shape (the
    published Qwen3.5-MoE's do: 512 wide, like the experts) and its gate the router's; else apart (shexp_gate,
    *_shexp)."""
    pairs = [(f"{p}ffn_{m}_exps.weight", f"{p}ffn_{m}_shexp.weight") for m in ("gate", "up", "down")]
    pairs.append((p + "ffn_gate_inp.weight", p + "ffn_gate_inp_shexp.weight"))

    def matches(experts: str, shared: str) -> bool:
        a, b = tensors.get(experts), tensors.get(shared)
        return a is not None and b is not None and a.ggml_type == b.ggml_type and a.shape[1:] in (b.shape, b.shape[1:])

    if all(matches(*pair) for pair in pairs):
        gate, up, down, router = (weight(pair) for pair in pairs)
        return {"router": router, "gate_exps": gate, "up_exps": up, "down_exps": down}
    names = ("gate_exps", "up_exps", "down_exps", "gate_shexp", "up_shexp", "down_shexp")
    return {"router": weight(p + "ffn_gate_inp.weight"), "shexp_gate": weight(p + "ffn_gate_inp_shexp.weight"),
            **{name: weight(f"{p}ffn_{name}.weight") for name in names}}  # fmt: skip
