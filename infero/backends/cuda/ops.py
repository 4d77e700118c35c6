"""The ops a model's forward pass is written against, on the GPU: each one a launch of our own kernels.

Activations are float32 DeviceTensors carved from the step's Workspace (reset before every forward, so a
replayed CUDA graph sees the same addresses); weights stay in their GGUF encoding (QuantWeight).
"""

from __future__ import annotations

import numpy as np

from infero.backends.cuda import attention, elementwise, embedding, gemm, matvec, skinny_gemm
from infero.backends.cuda.tensor import DeviceTensor, QuantWeight, empty, from_host
from infero.checkpoint.gguf import TensorInfo
from infero.checkpoint.tensor_types import SUPPORTED_TYPES, GGMLType
from infero.errors import UnsupportedModelError
from infero.models.rotary import Rotary

# Up to this many tokens a linear layer runs the int8 mat-vec kernels (matvec.cu: each weight byte read once for
# all tokens; the activations go in as two int8 planes, x and its rounding residual: one plane alone left SmolLM2's
# logits 1-7% off on the H200, docs/performance.md). Beyond it Q4_K / Q6_K / Q8_0 take the skinny tensor-core GEMM
# up to skinny_gemm.MAX_TOKENS tokens, everything else the GEMM.
MATVEC_MAX_TOKENS = 16
# From this many tokens a weight type takes the skinny GEMM even below MATVEC_MAX_TOKENS, where it beat the batched
# mat-vec on the H200 (docs/performance.md): llama-3.1-8b Q4_K_M steps of 4 / 8 / 16 sequences 5.3 / 8.3 / 15.9 ms on
# the mat-vec, 4.9 / 5.4 / 6.4 on the skinny GEMM, 2 sequences 3.5 vs 4.7; qwen2.5-0.5b Q8_0 steps of 4 / 5 / 8 / 16
# sequences 1.49 / 2.17 / 2.20 / 2.91 ms on the mat-vec, 1.79 / 2.03 / 1.81 / 2.10 on the skinny GEMM.
SKINNY_MIN_TOKENS = {int(GGMLType.Q4_K): 3, int(GGMLType.Q6_K): 3, int(GGMLType.Q8_0): 5}


class CudaKVCache:
    """Per layer, fp16 K and V of shape [num_blocks, block_size, num_kv_heads, head_dim]."""

    def __init__(self, k: list[DeviceTensor], v: list[DeviceTensor], block_size: int, num_blocks: int):
        self.k, self.v, self.block_size, self.num_blocks = k, v, block_size, num_blocks


class CudaOps:
    def __init__(self, backend):
        self.backend = backend
        self._rotary_tables: dict[int, DeviceTensor] = {}
        self._xq = self._xs = None  # the mat-vec's quantized activation (one at a time, see _quantized)
        self._quantized_key = None
        self._glu_q = self._glu_s = None  # matvec_glu's output, in the format: read while _xq holds its input
        self._glu_key = None
        self._skinny: dict[int, DeviceTensor] = {}  # per weight type, x in its skinny-GEMM column order
        self._skinny_keys: dict[int, tuple] = {}

    def prepare(self, config) -> None:
        """The fixed buffer of the mat-vec's quantized activation, for up to MATVEC_MAX_TOKENS rows of the widest
        linear input. One suffices: the stream runs every mat-vec reading one activation before the kernel that
        quantizes the next, so the next overwrites only what is no longer read."""
        widest = max(config.hidden_size, config.q_size, config.intermediate_size)
        widest = -(-widest // 32) * 32
        arena = self.backend.weights_arena
        q_shape, s_shape = matvec.activation_shapes(MATVEC_MAX_TOKENS, widest)
        self._xq = empty((int(np.prod(q_shape)),), np.int8, arena)
        self._xs = empty((int(np.prod(s_shape)),), np.int32, arena)
        self._quantized_key = None
        q_shape, s_shape = matvec.activation_shapes(2, -(-config.intermediate_size // 32) * 32)
        self._glu_q = empty((int(np.prod(q_shape)),), np.int8, arena)
        self._glu_s = empty((int(np.prod(s_shape)),), np.int32, arena)
        self._glu_key = None
        skinny_shape = skinny_gemm.activation_shape(skinny_gemm.MAX_TOKENS, -(-widest // 256) * 256)
        self._skinny = {t: empty(skinny_shape, np.uint32, arena) for t in skinny_gemm.TYPES}
        self._skinny_keys = {}

    def _skinny_input(self, x: DeviceTensor, ggml_type: int) -> DeviceTensor:
        """x converted for the skinny GEMM of ggml_type, once per activation (q and k, gate and up share it)."""
        n, cols = x.shape
        buffer = self._skinny[ggml_type]
        xa = DeviceTensor(buffer.ptr, skinny_gemm.activation_shape(n, cols), np.dtype(np.uint32), buffer)
        key = (x.ptr, x.shape, self.ws.generation)
        if self._skinny_keys.get(ggml_type) != key:
            skinny_gemm.convert(xa, x, ggml_type, self.stream)
            self._skinny_keys[ggml_type] = key
        return xa

    def _quantize_into(self, x: DeviceTensor, glu: bool = False):
        """The quantized-activation buffers viewed for x [n, cols], now owned by x; or None where x cannot
        take the format (more rows than the mat-vec takes, columns not a multiple of 32, no buffers). glu: the
        second pair, which matvec_glu writes while it reads its input from the first."""
        if not self._quantizable(x):
            return None
        n, cols = x.shape
        key = (x.ptr, x.shape, self.ws.generation)
        if glu:
            self._glu_key, xq, xs = key, self._glu_q, self._glu_s
        else:
            self._quantized_key, xq, xs = key, self._xq, self._xs
        q_shape, s_shape = matvec.activation_shapes(n, cols)
        return (DeviceTensor(xq.ptr, q_shape, np.dtype(np.int8), xq),
                DeviceTensor(xs.ptr, s_shape, np.dtype(np.int32), xs))  # fmt: skip

    def _quantizable(self, x: DeviceTensor) -> bool:
        return self._xq is not None and len(x.shape) == 2 and x.shape[0] <= MATVEC_MAX_TOKENS and x.shape[1] % 32 == 0

    def _quantized(self, x: DeviceTensor):
        """x in the mat-vec's activation format: the buffers as they are if x was the last activation written
        there (by a fused norm or SwiGLU, or an earlier linear), else after quantizing it now."""
        key = (x.ptr, x.shape, self.ws.generation)
        if key in (self._quantized_key, self._glu_key):
            return self._quantize_into(x, glu=key == self._glu_key)
        quantized = self._quantize_into(x)
        if quantized is not None:
            matvec.quantize(*quantized, x, self.stream)
        return quantized

    @property
    def ws(self):
        return self.backend.workspace

    @property
    def stream(self):
        return self.backend.stream

    def weight(self, tensor: TensorInfo):
        """Matrices stay in their stored encoding; vectors (norms, biases) become float32."""
        if tensor.ggml_type not in SUPPORTED_TYPES:
            raise UnsupportedModelError(
                f"tensor {tensor.name!r} has type {tensor.type_name}, which infero does not run"
            )
        arena = self.backend.weights_arena
        if len(tensor.shape) == 2:
            rows, cols = tensor.shape
            data = from_host(tensor.data.reshape(rows, -1), arena)
            return QuantWeight(data, tensor.ggml_type, rows, cols)
        from infero.checkpoint.dequantize import dequantize_tensor

        values = dequantize_tensor(tensor) if tensor.ggml_type != GGMLType.F32 else tensor.data.view(np.float32)
        return from_host(np.asarray(values, np.float32).reshape(tensor.shape), arena)

    def embedding(self, table: QuantWeight, token_ids: DeviceTensor) -> DeviceTensor:
        out = self.ws.empty((token_ids.shape[0], table.cols), np.float32)
        embedding.embedding(out, table, token_ids, self.stream)
        return out

    def rms_norm(self, x: DeviceTensor, weight: DeviceTensor, eps: float) -> DeviceTensor:
        out = self.ws.empty(x.shape, np.float32)
        elementwise.rms_norm(out, x, weight, eps, self.stream)
        return out

    def add_rms_norm(self, x: DeviceTensor, residual: DeviceTensor | None, weight: DeviceTensor, eps: float):
        out = self.ws.empty(x.shape, np.float32)
        quantized = self._quantize_into(out)  # what follows a norm is a linear layer: quantize for it on the way
        if residual is None:  # the first layer: the residual stream starts as x itself
            elementwise.add_rms_norm(out, x, None, weight, eps, self.stream, quantized)
            return out, x
        elementwise.add_rms_norm(out, residual, x, weight, eps, self.stream, quantized)
        return out, residual

    def _takes_skinny(self, x: DeviceTensor, weight: QuantWeight) -> bool:
        n = x.shape[0]
        return (bool(self._skinny) and skinny_gemm.supports(weight, n) and n >= SKINNY_MIN_TOKENS[weight.ggml_type]
                and len(x.shape) == 2 and x.ptr % 16 == 0)  # fmt: skip

    def linear(self, x: DeviceTensor, weight: QuantWeight, bias: DeviceTensor | None = None) -> DeviceTensor:
        n = x.shape[0]
        out = self.ws.empty((n, weight.rows), np.float32)
        if self._takes_skinny(x, weight):
            xa = self._skinny_input(x, weight.ggml_type)
            skinny_gemm.skinny_gemm(out, weight, xa, bias, self.stream, self.ws)
        elif n <= MATVEC_MAX_TOKENS:
            quantized = None if weight.ggml_type in matvec.FLOAT_TYPES else self._quantized(x)
            matvec.matvec(out, weight, x, bias, self.stream, self.ws, quantized)
        else:
            gemm.gemm(out, weight, x, bias, self.stream, self.ws)
        return out

    def linears(self, x: DeviceTensor, weights, biases=None) -> list[DeviceTensor]:
        """[linear(x, w, b) for each weight], with the matrices of one block format and width in one mat-vec launch
        (q/k/v, gate/up): bitwise what separate launches give, in fewer graph nodes (matvec.matvec_many). Float
        weights, and matrices the skinny GEMM takes at this width, run one linear call each."""
        biases = (None,) * len(weights) if biases is None else tuple(biases)
        if x.shape[0] > MATVEC_MAX_TOKENS:
            return [self.linear(x, w, b) for w, b in zip(weights, biases, strict=True)]
        outs: list = [None] * len(weights)
        shared = []
        for i, w in enumerate(weights):
            if w.ggml_type in matvec.FLOAT_TYPES or self._takes_skinny(x, w):
                outs[i] = self.linear(x, w, biases[i])
            else:
                shared.append(i)
        for group in _launch_groups(weights, shared):
            for i in group:
                outs[i] = self.ws.empty((x.shape[0], weights[i].rows), np.float32)
            matvec.matvec_many([outs[i] for i in group], [weights[i] for i in group], x,
                               [biases[i] for i in group], self.stream, self.ws, self._quantized(x))  # fmt: skip
        return outs

    def swiglu_gate_up(self, x: DeviceTensor, weights) -> DeviceTensor:
        """swiglu(*linears(x, (w_gate, w_up))); a decode step of one or two tokens whose gate and up take
        matvec.matvec_glu runs it as one launch, which writes the down projection's quantized input too (no
        SwiGLU kernel between the mat-vecs)."""
        gate, up = weights
        n = x.shape[0]
        if not (self._glu_q is not None and self._quantizable(x) and matvec.glu_fits(gate, up, n)
                and not self._takes_skinny(x, gate)):  # fmt: skip
            return self.swiglu(*self.linears(x, weights))
        out = self.ws.empty((n, gate.rows), np.float32)
        quantized = self._quantized(x)
        matvec.matvec_glu(out, gate, up, x, (None, None), quantized, self._quantize_into(out, glu=True), self.stream)
        return out

    def swiglu(self, gate: DeviceTensor, up: DeviceTensor) -> DeviceTensor:
        out = self.ws.empty(gate.shape, np.float32)
        aligned = out.ptr % 16 == 0 and gate.ptr % 16 == 0 and up.ptr % 16 == 0
        elementwise.swiglu(out, gate, up, self.stream, self._quantize_into(out) if aligned else None)
        return out

    def _inv_freq(self, rotary: Rotary) -> DeviceTensor:
        inv_freq = self._rotary_tables.get(id(rotary))
        if inv_freq is None:
            inv_freq = from_host(rotary.inv_freq.astype(np.float32), self.backend.weights_arena)
            self._rotary_tables[id(rotary)] = inv_freq
        return inv_freq

    def rotary_store_kv(self, q, k, v, positions, rotary: Rotary, cache: CudaKVCache, layer: int, slot_mapping):
        elementwise.rotary_store_kv(
            q, k, v, positions, self._inv_freq(rotary), rotary.mscale, rotary.pairing, rotary.rope_dim,
            cache.k[layer], cache.v[layer], slot_mapping, self.stream,
        )  # fmt: skip
        return q

    def qkv_rotary_store(self, x, weights, biases, head_dim: int, positions, rotary: Rotary, cache: CudaKVCache,
                         layer: int, slot_mapping) -> DeviceTensor:  # fmt: skip
        """q of [n, heads, head_dim]; k and v into the cache (see CpuOps.qkv_rotary_store). Decode steps of one or
        two tokens on block-format weights of several units per lane (matvec.rope_pays) run it as the q/k/v mat-vec
        with the rotation and the cache write in its epilogue (matvec.matvec_rope: one kernel fewer per layer,
        bitwise the same; one launch per type, or one for all three where matvec.mixes them); the rest as linears
        and rotary_store_kv."""
        n = x.shape[0]
        biases = (None,) * len(weights) if biases is None else tuple(biases)
        epilogue = all(w.ggml_type not in matvec.FLOAT_TYPES and not self._takes_skinny(x, w)
                       and matvec.rope_pays(w, head_dim, rotary.pairing) for w in weights)  # fmt: skip
        fused = n <= matvec.ROPE_MAX_TOKENS and rotary.rope_dim == head_dim and self._quantizable(x) and epilogue
        if not fused:
            q, k, v = (y.reshape(n, -1, head_dim) for y in self.linears(x, weights, biases))
            return self.rotary_store_kv(q, k, v, positions, rotary, cache, layer, slot_mapping)
        outs = [self.ws.empty((n, w.rows), np.float32) for w in weights]
        mixed = matvec.mixes(tuple(w.ggml_type for w in weights), weights[0].cols)
        for group in [[0, 1, 2]] if mixed else _launch_groups(weights, range(len(weights))):
            matvec.matvec_rope(
                [outs[i] for i in group], [weights[i] for i in group], tuple(matvec.ROPE_ROLES[i] for i in group), x,
                [biases[i] for i in group], positions, self._inv_freq(rotary), rotary.mscale, rotary.pairing,
                head_dim, cache.k[layer], cache.v[layer], slot_mapping, self.stream, self.ws, self._quantized(x),
            )  # fmt: skip
        return outs[0].reshape(n, -1, head_dim)

    def attention(self, q: DeviceTensor, cache: CudaKVCache, layer: int, batch, scale: float) -> DeviceTensor:
        out = self.ws.empty(q.shape, np.float32)
        # What follows is the output projection: a decode step's attention quantizes for its mat-vec on the way.
        quantized = self._quantize_into(out.reshape(q.shape[0], -1)) if batch.max_query_len == 1 else None
        attention.paged_attention(
            out, q, cache.k[layer], cache.v[layer], batch.block_tables, batch.context_lens, batch.query_starts,
            scale, batch.max_query_len, batch.max_context_len, self.stream, self.ws, batch.num_decode_seqs, quantized,
        )  # fmt: skip
        return out

    def gather_rows(self, x: DeviceTensor, rows: DeviceTensor) -> DeviceTensor:
        out = self.ws.empty((rows.shape[0],) + x.shape[1:], np.float32)
        elementwise.gather_rows(out, x, rows, self.stream)
        return out


def _launch_groups(weights, indices) -> list[list[int]]:
    """The weights at these indices in mat-vec launches: one block format and width per launch (Q4_K_M stores some
    layers' V as Q6_K: Q and K still share one), at most matvec.MAX_SEGMENTS matrices each."""
    by_kind: dict[tuple[int, int], list[int]] = {}
    for i in indices:
        by_kind.setdefault((weights[i].ggml_type, weights[i].cols), []).append(i)
    return [members[start : start + matvec.MAX_SEGMENTS] for members in by_kind.values()
            for start in range(0, len(members), matvec.MAX_SEGMENTS)]  # fmt: skip
