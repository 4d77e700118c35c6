"""The ops a model's forward pass is written against, on the GPU: each one a launch of our own kernels.

Activations are float32 DeviceTensors carved from the step's Workspace (reset before every forward, so a
replayed CUDA graph sees the same addresses); weights stay in their GGUF encoding (QuantWeight).
"""

from __future__ import annotations

import numpy as np

from infero.backends.cuda import (
    attention,
    delta_net,
    delta_rule_chunked,
    driver,
    elementwise,
    embedding,
    gemm,
    linear_mma,
    matvec,
    moe,
    skinny_gemm,
    weight_layout,
)
from infero.backends.cuda.tensor import DeviceTensor, QuantWeight, Strided, columns, empty, from_host
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
# 1: the skinny family takes its types (Q4_K, Q6_K, Q8_0) at every width: skinny_gemv to skinny_gemm.GEMV_MAX_TOKENS
# tokens, skinny_gemm to skinny_gemm.MAX_TOKENS, past that skinny_gemm on slices of that many. Every width then
# computes the skinny GEMM's fp16 numbers, so such a model's logits are the same bits at any batch and however its
# prompt is split (batch invariance by default, issue 29), its decode step's norms and SwiGLU in launches of their
# own: what scripts/ab_step.py and bench decode price against the tensor-core mat-vecs and the fp16 GEMM
# (docs/performance.md, "Next"). Off until measured on a GPU.
SKINNY_GEMV = 0
# In batch-invariant mode, from this many tokens a quantized linear layer that linear_mma takes runs it instead of
# the mat-vecs (the same bits: unit_value.cuh's definition). linear_mma's time hardly grows up to 16 tokens, the
# tensor-core mat-vec's grows with each (H200, 2026-12-04, e77ca4d; scripts/bench_linear_mma.py and
# bench_matvec_mma.py, us at 8 / 12 / 16 tokens): Q4_K 14336x4096 linear_mma 43.2 / 50.9 / 45.3, matvec_mma 39.1 /
# 66.3 / 76.8; Q4_K 4096x14336 40.9 / 46.9 / 42.1 against 36.9 / 58.8 / 66.5; Q6_K 4096x14336 65.4 / 72.6 / 69.5
# against - / 96.6 / -; the Q6_K head (128256x4096) 555.6 / 623.2 / 589.1 against - / 671.8 / -.
INVARIANT_GEMM_MIN_TOKENS = 10
# A float32 linear layer of at most this many rows runs moe.router's fp32 mat-vec (_few_float32_rows).
FEW_FLOAT32_ROWS = 256
# From this many tokens a mixture-of-experts layer sorts its (token, expert) pairs by expert and reads each chosen
# expert once per moe.GROUP_TOKENS of its pairs; below it each pair reads its expert's rows (no sort launch): at
# one token every pair has an expert of its own. qwen3-30b-a3b on the H200: the layer alone ran 8 tokens faster
# pair by pair (scripts/bench_moe_experts.py at 4eba79f: 114.8 us against 162.4 grouped; 32 tokens 397.5 against
# 352.3), but with grouping from 2 pairs an expert (31b548e) the decode step of 8 sequences took 8.55 ms against
# 7.34 (another machine start, whose batch-1 step was 9% slower) and bench serve at 8 clients 782 tok/s against 851.
# Again with four rows a warp (1a0b2e4, one machine start): pair by pair up to 31 tokens took qwen3.5-35b-a3b's steps
# of 8 / 16 sequences from 5.96 / 8.96 ms to 7.41 / 12.14, qwen3-30b-a3b's 16 from 10.58 to 11.21 ms, where the
# layer alone ran 8 tokens in 104.7 us pair by pair against 160.1 grouped.
MOE_GROUPED_MIN_TOKENS = 2
# From this many tokens a mixture-of-experts layer whose quantized expert types are all moe.MMA_TYPES sorts its pairs
# in runs of moe.MMA_GROUP for the tensor-core expert kernel (matvec_experts_mma); below it, in runs of
# moe.GROUP_TOKENS for the __dp4a one. Both give every pair its 1-token mat-vec's bits, so this only moves time.
# H200, 2026-12-04: since the kernel's Q6_K / Q8_0 windows and four Q4_K blocks an SM, qwen3-30b-a3b's layer alone
# with uniformly random routing (scripts/bench_moe_experts.py) at 16 / 24 / 32 tokens took 197 / 283 / 374 us pair
# by pair, 322 / 391 / 467 on the __dp4a groups, 222 / 252 / 296 on the tensor cores; the synthetic models' routing
# (not uniform) favours them more: from 16 instead of 32, qwen3-30b-a3b's decode steps of 16 / 24 sequences 12.72 /
# 16.19 -> 7.75 / 8.80 ms (32 unchanged: 10.5), bench serve at 32 clients unchanged (2,183 / 2,196 tok/s, fresh
# server); from 8 instead of 16, its steps of 8 / 12 sequences 8.37 / 7.69 -> 6.45 / 7.53 ms (second pair 8.32 /
# 7.55 -> 6.50 / 7.48), where the layer alone at 8 tokens took 151 us on the tensor cores, 185 on the __dp4a groups
# (108 pair by pair, which the models' own steps measured slower below 40 tokens: MOE_GROUPED_MIN_TOKENS).
MOE_MMA_MIN_TOKENS = 8


class CudaKVCache:
    """Per layer, fp16 K and V of shape [num_blocks, block_size, num_kv_heads, head_dim]."""

    def __init__(self, k: list[DeviceTensor], v: list[DeviceTensor], block_size: int, num_blocks: int):
        self.k, self.v, self.block_size, self.num_blocks = k, v, block_size, num_blocks


class CudaHybridCache(CudaKVCache):
    """A hybrid model's cache, laid out as CpuHybridCache: KV blocks for its full-attention layers only, and per
    state slot the float32 recurrent state of its Gated DeltaNet layers, conv [slots, recurrent layers, conv
    channels, kernel - 1] and delta [slots, recurrent layers, value heads, d_k, d_v]. The last slot is a spare that
    padded rows of a replayed decode graph write."""

    def __init__(self, k, v, block_size: int, num_blocks: int, conv: DeviceTensor, delta: DeviceTensor):
        super().__init__(k, v, block_size, num_blocks)
        self.conv, self.delta = conv, delta
        self.num_state_slots = conv.shape[0] - 1

    @staticmethod
    def state_shapes(config, slots: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        layers = config.num_recurrent_layers
        return ((slots, layers, config.conv_channels, config.ssm_conv_kernel - 1),
                (slots, layers, config.ssm_time_step_rank, config.ssm_state_size, config.linear_v_dim))  # fmt: skip


class CudaOps:
    def __init__(self, backend):
        self.backend = backend
        self._rotary_tables: dict[int, DeviceTensor] = {}
        # Two buffers of the mat-vec's quantized activation, so that a kernel can write its output there while it
        # reads its input from the other (matvec_glu, matvec_norm): per buffer its q and s planes, the activation
        # that owns it (_key) and, for linear_add_rms_norm's output, the deferred norm's eps (its sums of squares
        # follow the scales in the s buffer, matvec.Activation).
        self._act_q: list[DeviceTensor] = []
        self._act_s: list[DeviceTensor] = []
        self._act_keys: list = [None, None]
        self._act_norms: list = [None, None]
        self._skinny: dict[int, DeviceTensor] = {}  # per weight type, x in its skinny-GEMM column order
        self._skinny_keys: dict[int, tuple] = {}
        self._act_width = 0
        # Activations of more than MATVEC_MAX_TOKENS rows in the mat-vec's format, in the workspace: by _key, for
        # the readers after their writer; _ws_generation is the workspace generation they belong to.
        self._ws_acts: dict[tuple, matvec.Activation] = {}
        self._ws_generation = -1
        self._ws_deferred = -1  # the workspace generation of the last deferred-norm activation put there

    def prepare(self, config) -> None:
        """The fixed buffers of the mat-vec's quantized activation, for up to MATVEC_MAX_TOKENS rows of the widest
        linear input. Two suffice: the stream runs every mat-vec reading one activation before the kernel that
        quantizes the next, so the next overwrites only what is no longer read, and a kernel whose input is in one
        writes its output to the other."""
        widest = max(config.hidden_size, config.q_size, config.intermediate_size, config.ssm_inner_size,
                     config.shared_expert_intermediate_size)  # fmt: skip
        widest = -(-widest // 32) * 32
        self._act_width = widest
        arena = self.backend.weights_arena
        q_shape, s_shape = matvec.activation_shapes(MATVEC_MAX_TOKENS, widest)
        self._act_q = [empty((int(np.prod(q_shape)),), np.int8, arena) for _ in range(2)]
        # the scales, then a deferred norm's sums (Activation.norm_ss: 4 bytes a 32-element group)
        s_words = int(np.prod(s_shape)) + MATVEC_MAX_TOKENS * widest // 32
        self._act_s = [empty((s_words,), np.int32, arena) for _ in range(2)]
        self._act_keys, self._act_norms = [None, None], [None, None]
        skinny_shape = skinny_gemm.activation_shape(skinny_gemm.MAX_TOKENS, -(-widest // 256) * 256)
        self._skinny = {} if self.invariant else {t: empty(skinny_shape, np.uint32, arena) for t in skinny_gemm.TYPES}
        self._skinny_keys = {}

    def _skinny_input(self, x: DeviceTensor, ggml_type: int) -> DeviceTensor:
        """x converted for the skinny GEMM of ggml_type, once per activation (q and k, gate and up share it)."""
        n, cols = x.shape
        buffer = self._skinny[ggml_type]
        xa = DeviceTensor(buffer.ptr, skinny_gemm.activation_shape(n, cols), np.dtype(np.uint32), buffer)
        key = self._key(x)
        if self._skinny_keys.get(ggml_type) != key:
            self._require_values(x)
            skinny_gemm.convert(xa, x, ggml_type, self.stream)
            self._skinny_keys[ggml_type] = key
        return xa

    def _key(self, x: DeviceTensor) -> tuple:
        return (x.ptr, x.shape, self.ws.generation)

    def _quantize_into(self, x: DeviceTensor, keep: DeviceTensor | None = None, norm=None):
        """A quantized-activation buffer viewed for x [n, cols], now owned by x; or None where x cannot take the
        format (more rows than the mat-vec takes, columns not a multiple of 32, no buffers). keep: the activation
        the writing kernel reads meanwhile (its buffer is not taken). norm: the eps of a deferred RMSNorm
        (linear_add_rms_norm: the view gets its norm_ss)."""
        if not self._quantizable(x):
            return None
        key, kept = self._key(x), self._key(keep) if keep is not None else None
        slot = 1 if kept is not None and self._act_keys[0] == kept else 0
        self._act_keys[slot], self._act_norms[slot] = key, norm
        if self._act_keys[1 - slot] == key:  # x written anew: the other buffer's copy is stale
            self._act_keys[1 - slot] = None
        return self._activation(slot, x.shape)

    def _activation(self, slot: int, shape: tuple[int, int]) -> matvec.Activation:
        q_shape, s_shape = matvec.activation_shapes(*shape)
        xq, xs, eps = self._act_q[slot], self._act_s[slot], self._act_norms[slot]
        q = DeviceTensor(xq.ptr, q_shape, np.dtype(np.int8), xq)
        s = DeviceTensor(xs.ptr, s_shape, np.dtype(np.int32), xs)
        if eps is None:
            return matvec.Activation(q, s)
        norm_ss = DeviceTensor(s.ptr + s.nbytes, (shape[0], shape[1] // 32), np.dtype(np.float32), xs)
        return matvec.Activation(q, s, norm_ss, eps)

    def _quantizable(self, x: DeviceTensor) -> bool:
        return (bool(self._act_q) and len(x.shape) == 2 and x.shape[0] <= MATVEC_MAX_TOKENS and x.shape[1] % 32 == 0
                and x.shape[1] <= self._act_width)  # fmt: skip

    def _quantized(self, x: DeviceTensor):
        """x in the mat-vec's activation format: a buffer as it is if x was the last activation written there (by a
        fused norm, SwiGLU or attention, or an earlier linear), else after quantizing it now."""
        key = self._key(x)
        if key in self._act_keys:
            return self._activation(self._act_keys.index(key), x.shape)
        if (act := self._ws_act(key)) is not None:
            return act
        quantized = self._quantize_into(x)
        if quantized is None and len(x.shape) == 2 and x.shape[0] > MATVEC_MAX_TOKENS and x.shape[1] % 32 == 0:
            self._require_values(x)
            quantized = self._workspace_activation(x)
        if quantized is not None:
            matvec.quantize(quantized.q, quantized.s, x, self.stream)
        return quantized

    def _workspace_activation(self, x: DeviceTensor, norm=None) -> matvec.Activation:
        """A workspace buffer in the mat-vec's activation format for x (any number of rows), now owned by x. norm:
        the eps of a deferred RMSNorm (its norm_ss right after the scales, as the readers stage them)."""
        n, cols = x.shape
        q_shape, s_shape = matvec.activation_shapes(n, cols)
        q = self.ws.empty(q_shape, np.int8)
        if norm is None:
            act = matvec.Activation(q, self.ws.empty(s_shape, np.int32))
        else:
            both = self.ws.empty((n * cols // 8 + n * cols // 32,), np.int32)
            s = DeviceTensor(both.ptr, s_shape, np.dtype(np.int32), both)
            norm_ss = DeviceTensor(s.ptr + s.nbytes, (n, cols // 32), np.dtype(np.float32), both)
            act = matvec.Activation(q, s, norm_ss, norm)
            self._ws_deferred = self.ws.generation
        if self._ws_generation != self.ws.generation:  # a new forward: the earlier ones' buffers are gone
            self._ws_acts, self._ws_generation = {}, self.ws.generation
        self._ws_acts[self._key(x)] = act
        return act

    def _ws_act(self, key) -> matvec.Activation | None:
        """The workspace activation written for key in this forward, if any."""
        return self._ws_acts.get(key) if self._ws_generation == self.ws.generation else None

    def _require_values(self, x: DeviceTensor) -> None:
        """Raise if x is linear_add_rms_norm's output with a deferred norm, which has no float values, only its
        quantized form for the readers it was given (checked while a buffer still holds that form). Where no such
        output exists (every eager prefill step outside batch-invariant mode) it returns at once: an eager forward
        asks ~6 times a layer (the 48-layer qwen3moe of small widths at 128 tokens, GPU stubbed: 7.4 -> 7.0 ms of
        host time, scripts/cuda_host_overhead.py)."""
        norms = self._act_norms
        if norms[0] is None and norms[1] is None and self._ws_deferred != self.ws.generation:
            return
        key = self._key(x)
        norms = [norm for k, norm in zip(self._act_keys, self._act_norms, strict=True) if k == key]
        act = self._ws_act(key)
        if act is not None and act.norm_ss is not None or any(n is not None for n in norms):
            raise RuntimeError("a linear_add_rms_norm output whose norm its readers apply was read as float32 values; "
                               "pass every weight that reads it as `readers`")  # fmt: skip

    @property
    def ws(self):
        return self.backend.workspace

    @property
    def stream(self):
        return self.backend.stream

    @staticmethod
    def _require_supported(tensor: TensorInfo) -> None:
        if tensor.ggml_type not in SUPPORTED_TYPES:
            raise UnsupportedModelError(
                f"tensor {tensor.name!r} has type {tensor.type_name}, which infero does not run"
            )

    def weight(self, tensor: TensorInfo, gathered: bool = False, values: bool = False):
        """Matrices stay in their stored encoding (Q4_K and Q6_K linear layers tiled: weight_layout.py; gathered, a
        table whose rows are looked up by token id, in GGUF rows), expert tensors [experts, rows, cols] too, as one
        matrix of experts x rows GGUF rows (moe.ExpertWeights); vectors (norms, biases) become float32, and so does
        a table of `values` read elementwise (the delta net's conv taps)."""
        self._require_supported(tensor)
        arena = self.backend.weights_arena
        if len(tensor.shape) == 2 and not values:
            rows, cols = tensor.shape
            return weight_layout.upload(tensor.data, tensor.ggml_type, rows, cols, arena, gathered)
        if len(tensor.shape) == 3:
            experts, rows, cols = tensor.shape
            return moe.upload(tensor.data, tensor.ggml_type, experts, rows, cols, arena)
        from infero.checkpoint.dequantize import dequantize_tensor

        floats = dequantize_tensor(tensor) if tensor.ggml_type != GGMLType.F32 else tensor.data.view(np.float32)
        return from_host(np.asarray(floats, np.float32).reshape(tensor.shape), arena)

    def stacked_weight(self, parts: list[TensorInfo], shape: tuple[int, ...]):
        """Tensors of one type as one of `shape` (see weight): an expert tensor with one more expert after it (a
        folded shared expert) copied part by part into one allocation, as moe.upload lays it out, with no host copy
        of the whole (the 35B-A3B's expert tensors are 150 MB each); other stacks (a few rows) through weight."""
        first = parts[0]
        if len(shape) != 3:
            data = np.concatenate([t.data for t in parts])
            return self.weight(TensorInfo("+".join(t.name for t in parts), first.ggml_type, shape, data))
        self._require_supported(first)
        experts, rows, cols = shape
        data = empty((sum(t.nbytes for t in parts),), np.uint8, self.backend.weights_arena)
        offset = 0
        for t in parts:
            driver.copy_host_to_device(data.ptr + offset, t.data)
            offset += t.nbytes
        matrix = QuantWeight(data.reshape(experts * rows, offset // (experts * rows)), first.ggml_type, experts * rows,
                             cols)  # fmt: skip
        return moe.ExpertWeights(matrix, experts)

    def embedding(self, table: QuantWeight, token_ids: DeviceTensor) -> DeviceTensor:
        out = self.ws.empty((token_ids.shape[0], table.cols), np.float32)
        embedding.embedding(out, table, token_ids, self.stream)
        return out

    def rms_norm(self, x: DeviceTensor, weight: DeviceTensor, eps: float) -> DeviceTensor:
        out = self.ws.empty(x.shape, np.float32)
        elementwise.rms_norm(out, x, weight, eps, self.stream)
        return out

    def add_rms_norm(self, x: DeviceTensor, residual: DeviceTensor | None, weight: DeviceTensor, eps: float,
                     readers=()) -> tuple[DeviceTensor, DeviceTensor]:  # fmt: skip
        """The output also in the form its readers (the weights that read it, where known) take: the first
        skinny-GEMM reader's fp16 layout (its readers of that type then convert nothing), and the mat-vec's
        quantized activation unless every reader takes the skinny GEMM (what follows a norm is a linear layer:
        quantize for it on the way)."""
        out = self.ws.empty(x.shape, np.float32)
        skinny = self._skinny_output(out, readers)
        all_skinny = skinny is not None and all(self._takes_skinny(out, w) for w in readers)
        quantized = None if all_skinny else self._quantize_into(out)
        stream, added = (x, None) if residual is None else (residual, x)  # the first layer's stream starts as x
        elementwise.add_rms_norm(out, stream, added, weight, eps, self.stream, quantized, skinny)
        if skinny is not None:
            self._skinny_keys[skinny[1]] = self._key(out)
        return out, stream

    def _skinny_output(self, out: DeviceTensor, readers) -> tuple[DeviceTensor, int] | None:
        """(the skinny-GEMM input buffer viewed for out, its type) of the first reader the skinny GEMM takes at
        out's width, or None. With SKINNY_GEMV only until the norm's layout has run on a GPU (its test compares it
        with convert's); the default mode's skinny steps would then also drop a conversion a norm."""
        n, cols = out.shape if len(out.shape) == 2 else (0, 0)
        if not SKINNY_GEMV or not 0 < n <= skinny_gemm.MAX_TOKENS:
            return None
        for w in readers:
            if w.cols == cols and self._takes_skinny(out, w):
                buffer = self._skinny[w.ggml_type]
                xa = DeviceTensor(buffer.ptr, skinny_gemm.activation_shape(n, cols), np.dtype(np.uint32), buffer)
                return xa, w.ggml_type
        return None

    @property
    def invariant(self) -> bool:
        """Batch-invariant mode (CudaBackend.batch_invariant; docs/kernels.md): every quantized linear layer runs
        kernels that give each row the same bits (unit_value.cuh's definition): the mat-vecs (matvec_mma, matvec_q)
        below INVARIANT_GEMM_MIN_TOKENS tokens, from it the int8 tensor-core GEMM (linear_mma) where it takes the
        type, else the mat-vecs, past MATVEC_MAX_TOKENS in slices of it; float weights the float mat-vec in
        slices; a norm folded into its readers at every width or at none (linear_add_rms_norm). Off: the skinny
        GEMM and the fp16 GEMM, whose bits differ, are faster at their widths on the H200 (docs/performance.md)."""
        return getattr(self.backend, "batch_invariant", False)

    def _takes_skinny(self, x: DeviceTensor, weight: QuantWeight) -> bool:
        n = x.shape[0]
        width = min(n, skinny_gemm.MAX_TOKENS) if SKINNY_GEMV else n  # past MAX_TOKENS: slices
        return (not self.invariant and bool(self._skinny) and skinny_gemm.supports(weight, width)
                and (SKINNY_GEMV or n >= SKINNY_MIN_TOKENS[weight.ggml_type]) and len(x.shape) == 2
                and x.ptr % 16 == 0)  # fmt: skip

    def _takes_linear_mma(self, weight: QuantWeight, n: int) -> bool:
        return self.invariant and n >= INVARIANT_GEMM_MIN_TOKENS and linear_mma.supports(weight, n)

    def linear(self, x: DeviceTensor, weight: QuantWeight, bias: DeviceTensor | None = None) -> DeviceTensor:
        n = x.shape[0]
        out = self.ws.empty((n, weight.rows), np.float32)
        quantized = weight.ggml_type not in matvec.FLOAT_TYPES
        if bias is None and _few_float32_rows(x, weight):
            self._require_values(x)
            moe.router(out, x, weight, self.stream)
        elif self._takes_skinny(x, weight):
            self._require_values(x)
            for a in range(0, n, skinny_gemm.MAX_TOKENS):  # one slice but with SKINNY_GEMV
                b = min(a + skinny_gemm.MAX_TOKENS, n)
                x_part, out_part = (x, out) if b - a == n else (x.rows(a, b), out.rows(a, b))
                xa = self._skinny_input(x_part, weight.ggml_type)
                gemv = SKINNY_GEMV and b - a <= skinny_gemm.GEMV_MAX_TOKENS
                kernel = skinny_gemm.skinny_gemv if gemv else skinny_gemm.skinny_gemm
                kernel(out_part, weight, xa, bias, self.stream, self.ws)
        elif self._takes_linear_mma(weight, n):
            linear_mma.linear_mma(out, weight, self._quantized(x), bias, self.stream, self.ws)
        elif quantized and n <= MATVEC_MAX_TOKENS:
            matvec.matvec(out, weight, x, bias, self.stream, self.ws, self._quantized(x))
        elif n <= MATVEC_MAX_TOKENS or self.invariant:
            # The mat-vec's rows do not depend on its token count: slices of it give every row its bits.
            self._require_values(x)
            for a in range(0, n, MATVEC_MAX_TOKENS):
                b = min(a + MATVEC_MAX_TOKENS, n)
                matvec.matvec(out.rows(a, b), weight, x.rows(a, b), bias, self.stream, self.ws)
        else:
            self._require_values(x)
            gemm.gemm(out, weight, x, bias, self.stream, self.ws)
        return out

    def linear_add_rms_norm(self, x: DeviceTensor, weight: QuantWeight, residual: DeviceTensor, norm_weight, eps: float,
                            readers=()):  # fmt: skip
        """add_rms_norm(linear(x, weight), residual, norm_weight, eps). readers: the weights that read the normed
        output, each through a mat-vec (the next layer's q/k/v, or gate and up). Where the linear and all of its
        readers run on the tensor cores at one or two tokens (a decode step), the linear's own launch adds into the
        residual and writes the readers' activation, leaving the norm's 1 / rms to them (matvec.matvec_norm: no
        add_rms_norm kernel); the output then exists only in that form, for those readers. In batch-invariant mode
        the form is chosen by the weights alone, so that the readers see the same bits at every width: past the
        fused launch's widths add_rms_norm writes the deferred form."""
        n = x.shape[0]
        if not self._defers_norm(x, weight, residual, readers):
            return self.add_rms_norm(self.linear(x, weight), residual, norm_weight, eps, readers)
        h = self.ws.empty((n, weight.rows), np.float32)  # its readers take the quantized form
        if not (self._quantizable(x) and matvec.norm_fits(weight, n)):
            y = self.linear(x, weight)
            deferred = (self._quantize_into(h, norm=eps) if self._quantizable(h)
                        else self._workspace_activation(h, norm=eps))  # fmt: skip
            elementwise.add_rms_norm(h, residual, y, norm_weight, eps, self.stream, deferred)
            return h, residual
        quantized = self._quantized(x)
        out_quantized = self._quantize_into(h, keep=x, norm=eps)
        matvec.matvec_norm(residual, weight, x, quantized, norm_weight, out_quantized, self.stream)
        return h, residual

    def _defers_norm(self, x: DeviceTensor, weight: QuantWeight, residual, readers) -> bool:
        if (residual is None or not readers or weight.ggml_type in matvec.FLOAT_TYPES
                or any(w.ggml_type in matvec.FLOAT_TYPES or w.cols != weight.rows for w in readers)):  # fmt: skip
            return False
        if self.invariant:  # every width: the tensor-core mat-vecs to 16 tokens, linear_mma past them
            return matvec.norm_fits(weight, 1) and all(
                all(matvec.reads_deferred_norm(w, m) for m in (1, 2, MATVEC_MAX_TOKENS))
                and all(linear_mma.supports(w, m) for m in (MATVEC_MAX_TOKENS + 1, 2 * MATVEC_MAX_TOKENS + 1))
                for w in readers
            )
        n = x.shape[0]
        return (self._quantizable(x) and matvec.norm_fits(weight, n)
                and all(matvec.reads_deferred_norm(w, n) and not self._takes_skinny(x, w)
                        for w in readers))  # fmt: skip

    def linears(self, x: DeviceTensor, weights, biases=None) -> list[DeviceTensor]:
        """[linear(x, w, b) for each weight], with the matrices of one block format and width in one mat-vec launch
        (q/k/v, gate/up): bitwise what separate launches give, in fewer graph nodes (matvec.matvec_many; with
        SKINNY_GEMV, skinny_gemm.skinny_gemv_many). Float weights, and matrices the skinny GEMM or (batch-invariant
        mode) linear_mma takes at this width, run one linear call each."""
        biases = (None,) * len(weights) if biases is None else tuple(biases)
        if x.shape[0] > MATVEC_MAX_TOKENS:
            return [self.linear(x, w, b) for w, b in zip(weights, biases, strict=True)]
        outs: list = [None] * len(weights)
        shared, gemv = [], []
        few = SKINNY_GEMV and x.shape[0] <= skinny_gemm.GEMV_MAX_TOKENS
        for i, w in enumerate(weights):
            if few and self._takes_skinny(x, w):
                gemv.append(i)
            elif w.ggml_type in matvec.FLOAT_TYPES or self._takes_skinny(x, w) or self._takes_linear_mma(w, x.shape[0]):
                outs[i] = self.linear(x, w, biases[i])
            else:
                shared.append(i)
        for group in _launch_groups(weights, gemv):  # SKINNY_GEMV: a type's matrices in one skinny_gemv launch
            for i in group:
                outs[i] = self.ws.empty((x.shape[0], weights[i].rows), np.float32)
            skinny_gemm.skinny_gemv_many([outs[i] for i in group], [weights[i] for i in group],
                                         self._skinny_input(x, weights[group[0]].ggml_type),
                                         [biases[i] for i in group], self.stream, self.ws)  # fmt: skip
        for group in _launch_groups(weights, shared):
            for i in group:
                outs[i] = self.ws.empty((x.shape[0], weights[i].rows), np.float32)
            matvec.matvec_many([outs[i] for i in group], [weights[i] for i in group], x,
                               [biases[i] for i in group], self.stream, self.ws, self._quantized(x))  # fmt: skip
        return outs

    def swiglu_gate_up(self, x: DeviceTensor, weights, reader: QuantWeight | None = None) -> DeviceTensor:
        """swiglu(*linears(x, (w_gate, w_up))); a decode step of one or two tokens whose gate and up take
        matvec.matvec_glu runs it as one launch, which writes the down projection's quantized input too (no
        SwiGLU kernel between the mat-vecs). reader: the weight that reads the output (down), where known: with
        SKINNY_GEMV a few tokens' gate, up and SwiGLU take one skinny_gemv launch (where its block cannot hold both
        matrices' splits, gate and up one and SwiGLU one more), which writes the reader's fp16 input beside the
        float32 output (the reader converts nothing)."""
        gate, up = weights
        n = x.shape[0]
        if self._gemv_glu_fits(x, gate, up, reader):
            out = self.ws.empty((n, gate.rows), np.float32)
            xa = self._skinny_input(x, gate.ggml_type)
            t = reader.ggml_type
            down_xa = DeviceTensor(self._skinny[t].ptr, skinny_gemm.activation_shape(n, gate.rows),
                                   np.dtype(np.uint32), self._skinny[t])  # fmt: skip
            if skinny_gemm.gemv_glu_fits(gate, up, n):  # one launch: gate, up, SwiGLU, down's input
                skinny_gemm.skinny_gemv_glu(out, gate, up, xa, down_xa, t, self.stream)
            else:
                g, u = (self.ws.empty((n, gate.rows), np.float32) for _ in range(2))
                skinny_gemm.skinny_gemv_many([g, u], [gate, up], xa, [None, None], self.stream, self.ws)
                skinny_gemm.convert(down_xa, g, t, self.stream, up=u, out=out)
            self._skinny_keys[t] = self._key(out)
            return out
        if not (self._quantizable(x) and matvec.glu_fits(gate, up, n) and not self._takes_skinny(x, gate)):
            return self.swiglu(*self.linears(x, weights))
        out = self.ws.empty((n, gate.rows), np.float32)
        quantized = self._quantized(x)
        matvec.matvec_glu(out, gate, up, x, (None, None), quantized, self._quantize_into(out, keep=x), self.stream)
        return out

    def _gemv_glu_fits(self, x: DeviceTensor, gate: QuantWeight, up: QuantWeight, reader) -> bool:
        """Whether swiglu_gate_up runs SKINNY_GEMV's two launches: a few tokens, gate and up of one skinny type,
        shape and layout, and a reader the skinny family takes at this width."""
        n = x.shape[0]
        return (bool(SKINNY_GEMV) and n <= skinny_gemm.GEMV_MAX_TOKENS and reader is not None
                and self._takes_skinny(x, gate) and reader.cols == gate.rows
                and (up.ggml_type, up.rows, up.data.shape, up.tiled) == (gate.ggml_type, gate.rows, gate.data.shape,
                                                                        gate.tiled)
                and reader.ggml_type in skinny_gemm.TYPES and skinny_gemm.supports(reader, n))  # fmt: skip

    def swiglu(self, gate: DeviceTensor, up: DeviceTensor) -> DeviceTensor:
        out = self.ws.empty(gate.shape, np.float32)
        aligned = out.ptr % 16 == 0 and gate.ptr % 16 == 0 and up.ptr % 16 == 0
        elementwise.swiglu(out, gate, up, self.stream, self._quantize_into(out) if aligned else None)
        return out

    def moe_route(self, h: DeviceTensor, router: QuantWeight, k: int,
                  shared: bool = False) -> tuple[DeviceTensor, DeviceTensor]:  # fmt: skip
        """Each row's k experts (int32 [n, k], most probable first; equal probabilities: the lower id first) and
        their weights (float32 [n, k], the top-k probabilities renormalized to sum 1), on the device; shared: the
        router's last row is a shared expert's gate, and each row gets the shared expert as a (k + 1)-th pair (see
        CpuOps.moe_route). A float32
        router (as converters write it) runs moe.router, whose fp32 rows are the same bits at every n (on the GEMM,
        fp16 operands moved the routing weights by up to 3e-3 relative, H200, n = 64); up to moe.ROUTER_WARPS rows
        it routes them in the same launch, more take moe.route after it. Other float routers stay on the fp32
        mat-vec at every n, 16 rows a launch (its rows too are the same bits at every n); quantized ones take
        linear. Then moe.route."""
        n = h.shape[0]
        ids = self.ws.empty((n, k + shared), np.int32)
        weights = self.ws.empty((n, k + shared), np.float32)
        fused = n <= moe.ROUTER_WARPS
        if router.ggml_type == 0 and h.shape[1] % 4 == 0 and router.data.ptr % 16 == 0 and h.ptr % 16 == 0:
            self._require_values(h)
            logits = self.ws.empty((n, router.rows), np.float32)
            moe.router(logits, h, router, self.stream, (ids, weights) if fused else None, shared)
            if fused:
                return ids, weights
        elif router.ggml_type in matvec.FLOAT_TYPES and n > MATVEC_MAX_TOKENS:
            self._require_values(h)
            logits = self.ws.empty((n, router.rows), np.float32)
            for a in range(0, n, MATVEC_MAX_TOKENS):
                b = min(a + MATVEC_MAX_TOKENS, n)
                matvec.matvec(logits.rows(a, b), router, h.rows(a, b), None, self.stream, self.ws)
        else:
            logits = self.linear(h, router)
        moe.route(ids, weights, logits, self.stream, shared)
        return ids, weights

    def moe_experts(self, h: DeviceTensor, experts: DeviceTensor, weights: DeviceTensor, gate_exps, up_exps,
                    down_exps) -> DeviceTensor:  # fmt: skip
        """sum_r weights[:, r] * down_e(silu(gate_e h) * up_e h), e = experts[:, r] (see CpuOps.moe_experts): each
        (token, rank) pair's expert mat-vecs, SwiGLU, then moe.combine. From MOE_GROUPED_MIN_TOKENS tokens on, the
        pairs are first sorted by expert so that each chosen expert's rows are read once per moe.GROUP_TOKENS of
        its pairs (moe.grouped_matvec; from MOE_MMA_MIN_TOKENS on, where every quantized expert type is one of
        moe.MMA_TYPES, once per moe.MMA_GROUP on the tensor cores), else each pair reads its own
        (moe.expert_matvec), and down and the combine are one launch (moe.down_combine): the same bits every way.
        The pairs' buffers are dead once the combine is queued: the workspace takes them back (a replayed graph
        sees the same addresses)."""
        if moe.fp16_takes([gate_exps, up_exps, down_exps]):
            return self._moe_experts_fp16(h, experts, weights, gate_exps, up_exps, down_exps)
        n, k = experts.shape
        out = self.ws.empty((n, down_exps.rows), np.float32)
        mark = self.ws.offset
        pair_ids = experts.reshape(n * k)
        grouping = None
        quant_types = {m.ggml_type for m in (gate_exps, up_exps, down_exps)} & set(matvec.QUANT_TYPES)
        if n >= MOE_GROUPED_MIN_TOKENS and quant_types:
            tensor_cores = n >= MOE_MMA_MIN_TOKENS and quant_types <= set(moe.MMA_TYPES)
            run = moe.MMA_GROUP if tensor_cores else moe.GROUP_TOKENS
            grouping = moe.Grouping(self.ws.empty((n * k,), np.int32),
                                    self.ws.empty((moe.max_groups(n * k, gate_exps.experts, run), 4), np.int32),
                                    self.ws.empty((1,), np.int32), run)  # fmt: skip
            moe.sort(grouping, pair_ids, gate_exps.experts, self.stream)

        def expert_matvec(outs, mats, per_token, x, quantized):
            if grouping is not None and mats[0].ggml_type in matvec.QUANT_TYPES:
                moe.grouped_matvec(outs, mats, grouping, per_token, self.stream, quantized)
            else:
                moe.expert_matvec(outs, mats, pair_ids, per_token, self.stream, x, quantized)

        gate = self.ws.empty((n * k, gate_exps.rows), np.float32)
        up = self.ws.empty((n * k, up_exps.rows), np.float32)
        if gate_exps.ggml_type in matvec.FLOAT_TYPES and up_exps.ggml_type in matvec.FLOAT_TYPES:
            self._require_values(h)
            quantized = None
        else:
            quantized = self._moe_quantized(h)
        launches = [([gate, up], [gate_exps, up_exps])]
        if (gate_exps.ggml_type, gate_exps.matrix.data.shape) != (up_exps.ggml_type, up_exps.matrix.data.shape):
            launches = [([gate], [gate_exps]), ([up], [up_exps])]  # one launch takes one type and shape
        for outs, mats in launches:
            expert_matvec(outs, mats, k, h, quantized)
        if down_exps.ggml_type in matvec.FLOAT_TYPES:
            elementwise.swiglu(gate, gate, up, self.stream)
            down_quantized = None
        else:
            q_shape, s_shape = matvec.activation_shapes(n * k, gate.shape[1])
            down_quantized = (self.ws.empty(q_shape, np.int8), self.ws.empty(s_shape, np.int32))
            elementwise.swiglu(gate, gate, up, self.stream, down_quantized)
        if grouping is None and down_quantized is not None and k <= moe.COMBINE_MAX_K:
            moe.down_combine(out, down_exps, experts, weights, down_quantized, self.stream)
        else:
            y = self.ws.empty((n * k, down_exps.rows), np.float32)
            expert_matvec([y], [down_exps], 1, gate, down_quantized)
            moe.combine(out, y, weights, self.stream)
        self.ws.offset = mark
        return out

    def _moe_experts_fp16(self, h: DeviceTensor, experts: DeviceTensor, weights: DeviceTensor, gate_exps, up_exps,
                          down_exps) -> DeviceTensor:  # fmt: skip
        """moe_experts on the skinny GEMM's fp16 numbers (moe.FP16_EXPERTS): h converted once a weight type to its
        fp16 layout; from MOE_GROUPED_MIN_TOKENS tokens the pairs sorted by expert into runs of moe.fp16_run, below
        it each pair a group of its own (no sort); SwiGLU in the conversion of down's input; down, then moe.combine
        (in one launch where the pairs are not sorted). A pair's rows are the same bits every way."""
        n, k = experts.shape
        out = self.ws.empty((n, down_exps.rows), np.float32)
        mark = self.ws.offset
        pair_ids = experts.reshape(n * k)
        route = {"ids": pair_ids}
        if n >= MOE_GROUPED_MIN_TOKENS:
            run = moe.fp16_run(n * k, gate_exps.experts)
            grouping = moe.Grouping(self.ws.empty((n * k,), np.int32),
                                    self.ws.empty((moe.max_groups(n * k, gate_exps.experts, run), 4), np.int32),
                                    self.ws.empty((1,), np.int32), run)  # fmt: skip
            moe.sort(grouping, pair_ids, gate_exps.experts, self.stream)
            route = {"grouping": grouping}
        self._require_values(h)
        gate = self.ws.empty((n * k, gate_exps.rows), np.float32)
        up = self.ws.empty((n * k, up_exps.rows), np.float32)
        launches = [([gate, up], [gate_exps, up_exps])]
        if (gate_exps.ggml_type, gate_exps.matrix.data.shape) != (up_exps.ggml_type, up_exps.matrix.data.shape):
            launches = [([gate], [gate_exps]), ([up], [up_exps])]  # one launch takes one type and shape
        h_of: dict[int, DeviceTensor] = {}  # h in each weight type's fp16 layout
        for outs, mats in launches:
            t = mats[0].ggml_type
            if t not in h_of:
                h_of[t] = self.ws.empty(skinny_gemm.activation_rows_shape(*h.shape), np.uint32)
                skinny_gemm.convert(h_of[t], h, t, self.stream, rows_layout=True)
            moe.fp16_experts(outs, mats, k, h_of[t], self.stream, **route)
        ya = self.ws.empty(skinny_gemm.activation_rows_shape(*gate.shape), np.uint32)
        skinny_gemm.convert(ya, gate, down_exps.ggml_type, self.stream, rows_layout=True, up=up)  # SwiGLU with it
        if "ids" in route and k <= moe.COMBINE_MAX_K:
            moe.fp16_down_combine(out, down_exps, pair_ids, weights, ya, self.stream)
        else:
            y = self.ws.empty((n * k, down_exps.rows), np.float32)
            moe.fp16_experts([y], [down_exps], 1, ya, self.stream, **route)
            moe.combine(out, y, weights, self.stream)
        self.ws.offset = mark
        return out

    def _moe_quantized(self, h: DeviceTensor):
        """h in the mat-vec's activation format: a decode step's from the buffer its norm wrote (no launch), more rows
        quantized into the workspace."""
        if self._quantizable(h):
            return self._quantized(h)
        q_shape, s_shape = matvec.activation_shapes(*h.shape)
        quantized = (self.ws.empty(q_shape, np.int8), self.ws.empty(s_shape, np.int32))
        self._require_values(h)
        matvec.quantize(*quantized, h, self.stream)
        return quantized

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

    def qk_norm_rotary_store_kv(self, q, k, v, q_norm, k_norm, eps: float, positions, rotary: Rotary,
                                cache: CudaKVCache, layer: int, slot_mapping):  # fmt: skip
        """rms_norm of q and k per head, then rotary_store_kv, as one launch (bitwise the three); q is normed and
        rotated in place and returned, or, given as columns of wider heads (Qwen3.5's [q | gate]), read there and
        written to a new contiguous [n, heads, head_dim]."""
        q_in = None
        if isinstance(q, Strided):
            q_in, n = q, k.shape[0]
            q = self.ws.empty((n, q_in.rows // n if n else 0, q_in.cols), np.float32)
        elementwise.qk_norm_rotary_store_kv(
            q, k, v, q_norm, k_norm, eps, positions, self._inv_freq(rotary), rotary.mscale, rotary.pairing,
            rotary.rope_dim, cache.k[layer], cache.v[layer], slot_mapping, self.stream, q_in,
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

    # --- the hybrids' Gated DeltaNet and gated attention (delta_net.py; see CpuOps for each op's definition) -----
    def columns(self, x: DeviceTensor, start: int, stop: int) -> Strided:
        """Columns [start, stop) of x's last dim, read in place by the ops that take them."""
        return columns(x, start, stop)

    def sigmoid_gate(self, x: DeviceTensor, gate, addend: DeviceTensor | None = None) -> DeviceTensor:
        # Always a new tensor: x may be attention's output, whose quantized copy a decode step's attention wrote.
        out = self.ws.empty(x.shape, np.float32)
        delta_net.sigmoid_gate(out, x, gate, self.stream, addend)
        return out

    def reset_fresh_states(self, cache, batch) -> None:
        """Nothing to launch: CudaBackend zeroes fresh sequences' slots when it uploads the step (outside any graph,
        so a replayed decode step, whose sequences may be fresh, needs no reset node)."""

    def delta_net_inputs(self, qkv: DeviceTensor, alpha, beta, conv_weight: DeviceTensor, dt_bias: DeviceTensor,
                         a: DeviceTensor, key_heads: int, d_k: int, eps: float, cache, layer: int, batch,
                         group: int | None = None) -> tuple[DeviceTensor, DeviceTensor, DeviceTensor]:  # fmt: skip
        n, heads = qkv.shape[0], dt_bias.numel
        out = self.ws.empty(qkv.shape, np.float32)
        g, beta_out = self.ws.empty((n, heads), np.float32), self.ws.empty((n, heads), np.float32)
        group_stride = 0
        if alpha is None:  # Qwen3-Next's fused projection: per key head its `group` betas, then its alphas
            alpha, beta, group_stride = columns(beta, group, 2 * heads), columns(beta, 0, 2 * heads), 2 * group
        delta_net.delta_net_inputs(out, g, beta_out, qkv, conv_weight, cache.conv, alpha, beta, dt_bias, a, d_k,
                                   2 * key_heads * d_k, eps, batch.query_starts, batch.state_slots, layer,
                                   self.stream, group, group_stride, batch.max_query_len)  # fmt: skip
        return out, g, beta_out

    def gated_delta_rule(self, q, k, v, g, beta, pairing: str, scale: float, cache, layer: int, batch):
        """CpuOps.gated_delta_rule's output, each sequence's whole 64-position chunks by the chunked kernel and
        its other tokens by the recurrent one: those before its first whole chunk, then the chunks, then those
        after its last (docs/kernels.md, batch invariance rule 4). A step without a whole chunk (every decode
        step) or a d_k without the chunked kernel is one recurrent launch."""
        n, v_heads = g.shape
        out = self.ws.empty((n, v_heads, cache.delta.shape[4]), np.float32)
        rule = (out, q, k, v, g, beta, pairing, scale, cache.delta, batch.query_starts, batch.state_slots, layer,
                self.stream)  # fmt: skip
        if batch.num_whole_chunks == 0 or not delta_rule_chunked.takes(cache.delta.shape[3]):
            delta_net.gated_delta_rule(*rule)
            return out
        delta_net.gated_delta_rule(*rule, part="head", positions=batch.positions)
        delta_rule_chunked.delta_rule_chunked(out, q, k, v, g, beta, pairing, scale, cache.delta, batch.query_starts,
                                              batch.positions, batch.state_slots, layer, self.stream,
                                              self.ws)  # fmt: skip
        delta_net.gated_delta_rule(*rule, part="tail", positions=batch.positions)
        return out

    def gated_rms_norm(self, x: DeviceTensor, weight: DeviceTensor, gate, eps: float) -> DeviceTensor:
        out = self.ws.empty(x.shape, np.float32)
        delta_net.gated_rms_norm(out, x, weight, gate, eps, self.stream)
        return out


def _few_float32_rows(x: DeviceTensor, weight: QuantWeight) -> bool:
    """A float32 matrix of at most FEW_FLOAT32_ROWS rows (Qwen3.5's delta-net alpha and beta, 32 x 2048; its shared
    expert's gate, 1 x 2048) runs the router's fp32 mat-vec (moe.router): a block a row, its four warps a quarter
    of the row each, so the row's 8 KiB arrive in one round of loads, where matvec_f gives a row one warp (5-6 us a
    launch in qwen3.5-35b-a3b's decode step on the H200, 7a704eb); its rows are one expression at every n (the
    GEMM would round x to fp16 past 16 tokens)."""
    return (weight.ggml_type == 0 and weight.rows <= FEW_FLOAT32_ROWS and len(x.shape) == 2 and x.shape[1] % 4 == 0
            and x.ptr % 16 == 0 and weight.data.ptr % 16 == 0 and weight.data.shape[1] == 4 * weight.cols)  # fmt: skip


def _launch_groups(weights, indices) -> list[list[int]]:
    """The weights at these indices in mat-vec launches: one block format, width and layout per launch (Q4_K_M
    stores some layers' V as Q6_K: Q and K still share one; a tiled Q6_K row is longer than a GGUF one), at most
    matvec.MAX_SEGMENTS matrices each."""
    by_kind: dict[tuple[int, int, bool], list[int]] = {}
    for i in indices:
        by_kind.setdefault((weights[i].ggml_type, weights[i].cols, weights[i].tiled), []).append(i)
    return [members[start : start + matvec.MAX_SEGMENTS] for members in by_kind.values()
            for start in range(0, len(members), matvec.MAX_SEGMENTS)]  # fmt: skip
