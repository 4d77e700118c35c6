"""The ops a model's forward pass is written against, on the GPU: each one a launch of our own kernels.

Activations are float32 DeviceTensors carved from the step's Workspace (reset before every forward, so a
replayed CUDA graph sees the same addresses); weights stay in their GGUF encoding (QuantWeight).
"""

from __future__ import annotations

import numpy as np

from infero.backends.cuda import attention, elementwise, embedding, gemm, matvec
from infero.backends.cuda.tensor import DeviceTensor, QuantWeight, from_host
from infero.checkpoint.gguf import TensorInfo
from infero.checkpoint.tensor_types import SUPPORTED_TYPES, GGMLType
from infero.errors import UnsupportedModelError
from infero.models.rotary import Rotary

# Up to this many tokens a linear layer runs the int8 mat-vec kernels (matvec.cu: each weight byte read once for
# all tokens), beyond it the tensor-core GEMM. The activations go in as two int8 planes (x and its rounding
# residual): one plane alone left SmolLM2's logits 1-7% off on the H200 (docs/performance.md).
MATVEC_MAX_TOKENS = 16


class CudaKVCache:
    """Per layer, fp16 K and V of shape [num_blocks, block_size, num_kv_heads, head_dim]."""

    def __init__(self, k: list[DeviceTensor], v: list[DeviceTensor], block_size: int, num_blocks: int):
        self.k, self.v, self.block_size, self.num_blocks = k, v, block_size, num_blocks


class CudaOps:
    def __init__(self, backend):
        self.backend = backend
        self._rotary_tables: dict[int, DeviceTensor] = {}

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
        if residual is None:  # the first layer: the residual stream starts as x itself
            elementwise.add_rms_norm(out, x, None, weight, eps, self.stream)
            return out, x
        elementwise.add_rms_norm(out, residual, x, weight, eps, self.stream)
        return out, residual

    def linear(self, x: DeviceTensor, weight: QuantWeight, bias: DeviceTensor | None = None) -> DeviceTensor:
        n = x.shape[0]
        out = self.ws.empty((n, weight.rows), np.float32)
        if n <= MATVEC_MAX_TOKENS:
            matvec.matvec(out, weight, x, bias, self.stream, self.ws)
        else:
            gemm.gemm(out, weight, x, bias, self.stream, self.ws)
        return out

    def swiglu(self, gate: DeviceTensor, up: DeviceTensor) -> DeviceTensor:
        out = self.ws.empty(gate.shape, np.float32)
        elementwise.swiglu(out, gate, up, self.stream)
        return out

    def rotary_store_kv(self, q, k, v, positions, rotary: Rotary, cache: CudaKVCache, layer: int, slot_mapping):
        inv_freq = self._rotary_tables.get(id(rotary))
        if inv_freq is None:
            inv_freq = from_host(rotary.inv_freq.astype(np.float32), self.backend.weights_arena)
            self._rotary_tables[id(rotary)] = inv_freq
        elementwise.rotary_store_kv(
            q, k, v, positions, inv_freq, rotary.mscale, rotary.pairing, rotary.rope_dim,
            cache.k[layer], cache.v[layer], slot_mapping, self.stream,
        )  # fmt: skip
        return q

    def attention(self, q: DeviceTensor, cache: CudaKVCache, layer: int, batch, scale: float) -> DeviceTensor:
        out = self.ws.empty(q.shape, np.float32)
        attention.paged_attention(
            out, q, cache.k[layer], cache.v[layer], batch.block_tables, batch.context_lens, batch.query_starts,
            scale, batch.max_query_len, batch.max_context_len, self.stream, self.ws, batch.num_decode_seqs,
        )  # fmt: skip
        return out

    def gather_rows(self, x: DeviceTensor, rows: DeviceTensor) -> DeviceTensor:
        out = self.ws.empty((rows.shape[0],) + x.shape[1:], np.float32)
        elementwise.gather_rows(out, x, rows, self.stream)
        return out
