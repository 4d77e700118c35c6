"""numpy reference ops: simple and obviously right, the oracle every CUDA kernel is tested against.

Activations are float32; weights are dequantized to float32 once at load. Matrices are [out, in] row-major,
as GGUF stores them, and multiply as x @ W.T (BLAS reads the transpose in place, no copy).
"""

from __future__ import annotations

import numpy as np

from infero.backends.cpu import delta_net
from infero.checkpoint.config import ModelConfig
from infero.checkpoint.dequantize import dequantize_tensor
from infero.checkpoint.gguf import TensorInfo
from infero.engine.batch import Batch
from infero.models.rotary import Rotary


class CpuKVCache:
    """Per-layer K and V blocks: float32 [num_blocks, block_size, num_kv_heads, head_dim]."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int):
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.block_size, self.num_blocks = block_size, num_blocks
        self.k = [np.zeros(shape, np.float32) for _ in range(num_layers)]
        self.v = [np.zeros(shape, np.float32) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * 4


class CpuHybridCache(CpuKVCache):
    """A hybrid model's cache: KV blocks for its full-attention layers only (in layer order), and per state slot the
    recurrent state of its Gated DeltaNet layers (in layer order): conv float32 [slots, recurrent layers, conv
    channels, kernel - 1] (the last inputs, oldest first) and delta float32 [slots, recurrent layers, value heads,
    d_k, d_v] (the delta rule's S)."""

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, num_state_slots: int):
        attention_layers = config.num_layers - config.num_recurrent_layers
        super().__init__(attention_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim)
        layers = config.num_recurrent_layers
        self.conv = np.zeros((num_state_slots, layers, config.conv_channels, config.ssm_conv_kernel - 1), np.float32)
        self.delta = np.zeros((num_state_slots, layers, config.ssm_time_step_rank, config.ssm_state_size,
                               config.linear_v_dim), np.float32)  # fmt: skip

    @staticmethod
    def bytes_per_slot(config: ModelConfig) -> int:
        per_layer = config.conv_channels * (config.ssm_conv_kernel - 1)
        per_layer += config.ssm_time_step_rank * config.ssm_state_size * config.linear_v_dim
        return 4 * config.num_recurrent_layers * per_layer


class CpuOps:
    """The backend operations a model's forward pass is written against."""

    def weight(self, tensor: TensorInfo, gathered: bool = False, values: bool = False) -> np.ndarray:
        """Every tensor as float32 values (gathered and values matter to the CUDA backend's encodings only)."""
        return dequantize_tensor(tensor)

    def stacked_weight(self, parts: list[TensorInfo], shape: tuple[int, ...]) -> np.ndarray:
        """Tensors of one type as one of `shape`, each part's items (rows, or an expert tensor's matrices) in turn."""
        return np.concatenate([dequantize_tensor(t).reshape(-1, *shape[1:]) for t in parts])

    def embedding(self, table: np.ndarray, token_ids: np.ndarray) -> np.ndarray:
        return table[token_ids]

    def rms_norm(self, x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
        """Normalise over the last axis (works for [n, hidden] and per head for [n, heads, head_dim])."""
        variance = np.mean(np.square(x, dtype=np.float32), axis=-1, keepdims=True)
        return (x / np.sqrt(variance + eps)) * weight

    def add_rms_norm(
        self, x: np.ndarray, residual: np.ndarray | None, weight: np.ndarray, eps: float, readers=()
    ) -> tuple[np.ndarray, np.ndarray]:
        """residual += x (residual starts as x), then return (rms_norm(residual), residual). readers: the weights
        that read the output, where known (the CUDA backend writes their input form on the way)."""
        residual = x if residual is None else residual + x
        return self.rms_norm(residual, weight, eps), residual

    def linear_add_rms_norm(self, x, weight, residual, norm_weight, eps: float, readers=()):
        """add_rms_norm(linear(x, weight), residual, norm_weight, eps); readers (the weights that read the normed
        output) matter to the GPU only."""
        return self.add_rms_norm(self.linear(x, weight), residual, norm_weight, eps)

    def linear(self, x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
        """x @ W.T one row at a time.

        BLAS picks its kernel, and so a row's summation order, by the number of rows (gemv for one, small-matrix
        kernels for a few, gemm for more), so in one product a row's result would depend on how many rows share
        it. Row by row every row always takes the same path, whatever else is in the batch (tests pin this). It
        costs little: the rows of a step follow each other through one matrix while it sits in the CPU's cache,
        so the weights still come from memory about once per step (measured on SmolLM2: the row loop prefills
        faster than 4-row gemm products).
        """
        y = np.empty((x.shape[0], weight.shape[0]), np.float32)
        wt = weight.T
        for i in range(x.shape[0]):
            y[i] = x[i] @ wt
        return y if bias is None else y + bias

    def linears(self, x: np.ndarray, weights, biases=None) -> list[np.ndarray]:
        """[linear(x, w, b) for each weight] (the CUDA backend shares launches between them)."""
        biases = (None,) * len(weights) if biases is None else biases
        return [self.linear(x, w, b) for w, b in zip(weights, biases, strict=True)]

    def swiglu(self, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
        return gate / (1.0 + np.exp(-gate)) * up

    def swiglu_gate_up(self, x: np.ndarray, weights, reader=None) -> np.ndarray:
        """silu(x W_gate) * (x W_up) for weights (W_gate, W_up) (the CUDA backend runs it as one launch; reader, the
        weight that reads the output, lets it write that weight's input form too)."""
        return self.swiglu(*self.linears(x, weights))

    def moe_route(self, x: np.ndarray, router: np.ndarray, k: int,
                  shared: bool = False) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
        """Each row's k experts and their weights (Qwen3-MoE routing): softmax over every expert's router logit,
        the k most probable, their probabilities renormalized to sum 1. Experts are int64 [n, k], most probable
        first; equal probabilities rank the lower expert id first, so a tie always picks the same expert.

        shared (a shared expert folded in as one more expert, Qwen3.5-MoE's): the router's last row is the shared
        expert's gate, not an expert's; the routing is over the others, and each row's (k + 1)-th pair is the
        shared expert (id: the router's last row) with weight sigmoid(its gate logit), not renormalized. The
        experts' weighted sum then adds it last, as routed + sigmoid(gate) shared."""
        logits = self.linear(x, router)
        if shared:
            logits, gate = logits[:, :-1], logits[:, -1:]
        probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
        probs /= probs.sum(axis=-1, keepdims=True)
        experts = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
        weights = np.take_along_axis(probs, experts, axis=-1)
        weights = weights / weights.sum(axis=-1, keepdims=True)
        if not shared:
            return experts, weights
        shared_ids = np.full((len(experts), 1), logits.shape[1], experts.dtype)
        return np.concatenate([experts, shared_ids], 1), np.concatenate([weights, 1.0 / (1.0 + np.exp(-gate))], 1)

    def moe_experts(self, x: np.ndarray, experts: np.ndarray, weights: np.ndarray, w_gate: np.ndarray,
                    w_up: np.ndarray, w_down: np.ndarray) -> np.ndarray:  # fmt: skip
        """sum_r weights[:, r] * down_e(silu(gate_e x) * up_e x) with e = experts[:, r], for expert matrices
        [num_experts, out, in].

        Each row goes through its experts alone, as linear does (so its result never depends on which other rows
        chose the same expert), and its k outputs are added in rank order. The loop runs expert by expert so a
        matrix is read from memory once per step, however many rows chose it.
        """
        n, k = experts.shape
        y = np.empty((n, k, w_down.shape[1]), np.float32)
        for e in np.unique(experts):
            rows, ranks = np.nonzero(experts == e)
            gate, up, down = w_gate[e].T, w_up[e].T, w_down[e].T
            for row, rank in zip(rows, ranks, strict=True):
                y[row, rank] = self.swiglu(x[row] @ gate, x[row] @ up) @ down
        out = weights[:, 0, None] * y[:, 0]
        for r in range(1, k):
            out += weights[:, r, None] * y[:, r]
        return out

    def _rotary(self, x: np.ndarray, positions: np.ndarray, rotary: Rotary) -> np.ndarray:
        """Rotate the first rope_dim dimensions of every head of x [n, heads, head_dim] by position."""
        cos, sin = rotary.cos_sin(positions)
        cos, sin = cos[:, None, :], sin[:, None, :]
        d = rotary.rope_dim
        out = x.copy()
        if rotary.pairing == "interleaved":
            a, b = x[..., 0:d:2], x[..., 1:d:2]
            out[..., 0:d:2] = a * cos - b * sin
            out[..., 1:d:2] = b * cos + a * sin
        else:
            a, b = x[..., : d // 2], x[..., d // 2 : d]
            out[..., : d // 2] = a * cos - b * sin
            out[..., d // 2 : d] = b * cos + a * sin
        return out

    def rotary_store_kv(self, q, k, v, positions, rotary: Rotary, cache: CpuKVCache, layer: int, slot_mapping):
        """Rotate q and k by position, write k and v [n, kv_heads, head_dim] into their cache slots; return q."""
        k = self._rotary(k, positions, rotary)
        bs = cache.block_size
        cache.k[layer][slot_mapping // bs, slot_mapping % bs] = k
        cache.v[layer][slot_mapping // bs, slot_mapping % bs] = v
        return self._rotary(q, positions, rotary)

    def qk_norm_rotary_store_kv(self, q, k, v, q_norm, k_norm, eps: float, positions, rotary: Rotary,
                                cache: CpuKVCache, layer: int, slot_mapping):  # fmt: skip
        """rotary_store_kv of q and k after each head's rms_norm (weights q_norm, k_norm: Qwen3's q/k norms)."""
        q, k = self.rms_norm(q, q_norm, eps), self.rms_norm(k, k_norm, eps)
        return self.rotary_store_kv(q, k, v, positions, rotary, cache, layer, slot_mapping)

    def qkv_rotary_store(self, x, weights, biases, head_dim: int, positions, rotary: Rotary, cache: CpuKVCache,
                         layer: int, slot_mapping) -> np.ndarray:  # fmt: skip
        """The attention inputs of x: its q, k and v projections (weights and biases in that order) as heads of
        head_dim, rotated and stored as rotary_store_kv does; returns q [n, heads, head_dim]."""
        q, k, v = (y.reshape(len(x), -1, head_dim) for y in self.linears(x, weights, biases))
        return self.rotary_store_kv(q, k, v, positions, rotary, cache, layer, slot_mapping)

    def gather_rows(self, x: np.ndarray, rows: np.ndarray) -> np.ndarray:
        return x[rows]

    def sigmoid_gate(self, x: np.ndarray, gate: np.ndarray, addend: np.ndarray | None = None) -> np.ndarray:
        """x * sigmoid(gate) (gate broadcasts: one column gates a whole row), plus addend where given."""
        gated = x / (1.0 + np.exp(-gate))
        return gated if addend is None else addend + gated

    def columns(self, x: np.ndarray, start: int, stop: int) -> np.ndarray:
        """Columns [start, stop) of x's last axis, as a view (the CUDA backend reads them in place too)."""
        return x[..., start:stop]

    def reset_fresh_states(self, cache: CpuHybridCache, batch: Batch) -> None:
        """Zero the recurrent state of every sequence whose step starts at position 0: a new sequence, or one
        recomputed after preemption, never sees what its slot held before."""
        if (batch.state_slots < 0).any():  # -1 would index the last slot: another sequence's state
            raise ValueError("every sequence of a hybrid model's batch needs a recurrent-state slot")
        fresh = batch.state_slots[batch.context_lens == batch.query_lens]
        cache.conv[fresh] = 0.0
        cache.delta[fresh] = 0.0

    def delta_net_inputs(self, qkv, alpha, beta, conv_weight, dt_bias, a, key_heads: int, d_k: int, eps: float,
                         cache: CpuHybridCache, layer: int, batch: Batch,
                         group: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
        """What the delta rule reads, from the projections qkv [n, channels] (q | k | v) and alpha, beta [n, value
        heads]: SiLU of the causal depthwise conv1d of qkv (taps conv_weight [channels, kernel]) over each
        sequence's earlier inputs, kept in its slot's conv state for recurrent layer `layer`, with q and k (the first
        2 key_heads x d_k channels) L2-normed per head of d_k; the log decay g = a * softplus(alpha + dt_bias)
        (a = -exp(A_log) < 0) and the write strength sigmoid(beta), [n, value heads]. alpha None: beta is
        Qwen3-Next's fused projection, per key head its `group` betas then its `group` alphas."""
        out = np.empty_like(qkv)
        starts = batch.query_starts
        for s, slot in enumerate(batch.state_slots):
            lo, hi = int(starts[s]), int(starts[s + 1])
            out[lo:hi] = delta_net.causal_conv1d(qkv[lo:hi], conv_weight, cache.conv[slot, layer])
        n, normed = len(out), 2 * key_heads * d_k
        out[:, :normed] = delta_net.l2_norm(out[:, :normed].reshape(n, 2 * key_heads, d_k), eps).reshape(n, normed)
        if alpha is None:
            heads = dt_bias.shape[0]
            fused = beta.reshape(n, heads // group, 2, group)
            beta, alpha = fused[:, :, 0].reshape(n, heads), fused[:, :, 1].reshape(n, heads)
        return out, a * np.logaddexp(np.float32(0.0), alpha + dt_bias), 1.0 / (1.0 + np.exp(-beta))

    def gated_delta_rule(self, q, k, v, g, beta, pairing: str, scale: float, cache: CpuHybridCache, layer: int,
                         batch: Batch) -> np.ndarray:  # fmt: skip
        """o [n, value heads, d_v] of the gated delta rule for q, k [n, key heads x d_k] (q scaled by `scale`),
        v [n, value heads x d_v], g and beta [n, value heads]; value head h reads key head h % key heads (pairing
        "tiled") or h // (value heads / key heads) ("grouped"). Run token by token from each sequence's state in
        its slot (the recurrent form: any split of a prompt gives the same bits)."""
        (n, v_heads), d_k = g.shape, cache.delta.shape[3]
        q, k, v = q.reshape(n, -1, d_k), k.reshape(n, -1, d_k), v.reshape(n, v_heads, -1)
        k_heads = key_head_of(pairing, q.shape[1], v_heads)
        q, k = q[:, k_heads] * np.float32(scale), k[:, k_heads]
        out = np.empty(v.shape, np.float32)
        starts = batch.query_starts
        for s, slot in enumerate(batch.state_slots):
            lo, hi = int(starts[s]), int(starts[s + 1])
            state = cache.delta[slot, layer]
            out[lo:hi] = delta_net.delta_rule_recurrent(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], state)
        return out

    def gated_rms_norm(self, x: np.ndarray, weight: np.ndarray, gate: np.ndarray, eps: float) -> np.ndarray:
        """rms_norm(x) * weight * silu(gate) over each head of x [n, heads, dim] (the delta net's output norm; gate
        [n, heads x dim])."""
        gate = gate.reshape(x.shape)
        return self.rms_norm(x, weight, eps) * (gate / (1.0 + np.exp(-gate)))

    def attention(self, q: np.ndarray, cache: CpuKVCache, layer: int, batch: Batch, scale: float) -> np.ndarray:
        """Causal grouped-query attention of q [n, heads, head_dim] over each sequence's cached K/V."""
        out = np.empty_like(q)
        starts = batch.query_starts
        bs = cache.block_size
        for s in range(batch.num_seqs):
            lo, hi = int(starts[s]), int(starts[s + 1])
            ctx = int(batch.context_lens[s])
            pos = np.arange(ctx)
            slots_block = batch.block_tables[s][pos // bs]
            k = cache.k[layer][slots_block, pos % bs]  # [ctx, kv_heads, head_dim]
            v = cache.v[layer][slots_block, pos % bs]
            out[lo:hi] = _causal_gqa(q[lo:hi], k, v, scale)
        return out


def key_head_of(pairing: str, key_heads: int, v_heads: int) -> np.ndarray:
    """The key head each value head reads: "tiled" (qwen35 files, whose converter reorders the value heads) h % key
    heads, "grouped" (qwen3next, transformers' order) h // (value heads / key heads)."""
    heads = np.arange(v_heads)
    return heads % key_heads if pairing == "tiled" else heads // (v_heads // key_heads)


def _causal_gqa(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float) -> np.ndarray:
    """Attention of n queries (the last n of ctx positions) over ctx keys, query heads grouped on KV heads.

    One query at a time, over exactly the keys it sees: every product and sum then has a shape fixed by the query's
    position alone (BLAS picks its kernel, and so its summation order, by shape), so a query's bits do not depend on
    how many queries share its chunk, i.e. on how its prompt was split (a prefix cache hit is such a split)."""
    n, heads, hd = q.shape
    ctx, kv_heads, _ = k.shape
    group = heads // kv_heads
    kt = k.transpose(1, 2, 0)  # [kv, hd, ctx]
    vt = v.transpose(1, 0, 2)  # [kv, ctx, hd]
    out = np.empty_like(q)
    for i in range(n):
        seen = ctx - n + i + 1
        scores = (q[i].reshape(kv_heads, group, hd) @ kt[:, :, :seen]) * scale  # [kv, group, seen]
        scores -= scores.max(axis=-1, keepdims=True)
        probs = np.exp(scores)
        probs /= probs.sum(axis=-1, keepdims=True)
        out[i] = (probs @ vt[:, :seen]).reshape(heads, hd)
    return out
