"""Launchers for a mixture-of-experts layer on the GPU: routing (kernels/moe.cu's moe_route), the chosen experts'
mat-vecs (matvec.cu's matvec_experts, matvec_experts_grouped, matvec_experts_f; moe_mma.cu's matvec_experts_mma;
with FP16_EXPERTS skinny_gemm.cu's skinny_experts) and the weighted sum of their outputs (moe_combine).

Every step stays on the device (a decode step is one CUDA graph): the router's logits come from the linear layer,
moe_route turns each row into k expert ids and weights, and each (token, rank) pair p = t k + r runs the 1-token
mat-vec of its expert, reading only that expert's rows. A pair's output is bitwise the 1-token mat-vec of that
expert (matvec_q's, or matvec_f's, arithmetic and reduction order), so a token's output never depends on which or
how many other tokens chose its experts, nor on the batch (docs/kernels.md, "Batch invariance"). Where tokens share
experts (prefill, batched steps), moe_sort groups the pairs by expert and matvec_experts_grouped reads each chosen
expert's rows once per GROUP_TOKENS of its pairs, every pair's row still bitwise its 1-token mat-vec; for the
MMA_TYPES, groups of MMA_GROUP pairs can take matvec_experts_mma instead (the int8 tensor cores, the same bits).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from infero.backends.cuda import driver, matvec, runtime, skinny_gemm, weight_layout
from infero.backends.cuda.tensor import DeviceTensor, QuantWeight

SOURCE = "moe.cu"
THREADS = 256  # moe_combine's block
MAX_WARPS = 4  # warps per block of the expert mat-vecs (their __launch_bounds__(128))
# Rows a warp of the one-token expert mat-vecs computes (matvec_experts, and matvec_experts_combine's warps): an
# expert's rows are short (64 units of 32 at 2048 columns, 24 at 768), so more rows a warp put more of its loads in
# flight before the block's chain of dependent loads (ids, weights, activations) ends. qwen3-30b-a3b's layer on the
# H200 (scripts/bench_moe_experts.py --pair-rpw, 2026-12-03, d9eb142), pair by pair at 2 / 4 / 8 rows a warp: 1
# token 25.5 / 23.6 / 26.4 us, 8 tokens 126.9 / 104.7 / 120.4, 32 tokens 456 / 348 / 391.
PAIR_RPW = 4
COMBINE_RPW = 4
GROUP_TOKENS = 8  # pairs of one expert that a block of matvec_experts_grouped computes from one read of its rows
GROUP_RPW = 2  # rows a warp of it computes (4 took Q4_K from 122 registers to 152, Q3_K to 255)
MMA_SOURCE = "moe_mma.cu"
MMA_TYPES = (12, 13, 14, 8)  # Q4_K, Q5_K, Q6_K, Q8_0: what Q4_K_M / Q5_K_M / Q6_K / Q8_0 files put in their experts
MMA_GROUPS = (16, 32, 64)  # the pairs a block of matvec_experts_mma computes (each instantiated)
# The run length CudaOps.moe_experts sorts into for it (must differ from GROUP_TOKENS). One qwen3-30b-a3b layer's
# experts on the H200 (scripts/bench_moe_experts.py, 2026-12-03, a71277e), us for groups of 16 / 32 / 64 against
# the __dp4a kernel's 8: 128 tokens 740 / 1,376 / 7,209 against 863; 512 tokens 1,865 / 2,155 / 5,852 against 3,019.
MMA_GROUP = 16
MMA_WARPS = 4  # matvec_experts_mma's warps a block: G / 16 split the pairs, the others 16 rows each
COMBINE_MAX_K = 16  # experts a token may choose for down_combine (matvec.cu's COMBINE_MAX_K: a warp each)
ROUTER_WARPS, ROUTER_TOKENS = 4, 16  # moe.cu's: moe_router's warps a block (one routes a token) and tokens a block
ROUTER_TILE = 8  # moe.cu's: moe_router_tiles' experts and tokens a block
# From this many rows the router's logits take moe_router_tiles (the same bits; up to ROUTER_WARPS rows moe_router
# also routes them). qwen3-30b-a3b's router (2048 x 128) on the H200, us with moe_router alone -> moe_router_tiles
# (scripts/bench_moe_route.py --tiles-min 1,100000, 2026-12-04): 8 / 32 / 512 / 2,048 rows 8.1 / 12.1 / 47.1 /
# 154.9 -> 7.6 / 7.6 / 19.8 / 59.1.
ROUTER_TILES_MIN_TOKENS = 8
SORT_THREADS = 1024
MAX_EXPERTS = 4096  # moe_sort keeps 4 ints an expert in shared memory (64 KiB at 4096)

runtime.declare(SOURCE, ["moe_route", "moe_combine", "moe_sort"], needs=(runtime.EXPERTS,))
# The router's fp32 mat-vec also runs every float32 matrix of few rows (CudaOps.linear): a model with any.
runtime.declare(SOURCE, ["moe_router", "moe_router_tiles"], needs=(runtime.weight_type(0),))
for _t in matvec.QUANT_TYPES:
    _names = [
        f"matvec_experts<{_t}, {PAIR_RPW}>",
        f"matvec_experts_grouped<{_t}, {GROUP_TOKENS}, {GROUP_RPW}>",
        f"matvec_experts_combine<{_t}, {COMBINE_RPW}>",
    ]
    runtime.declare(matvec.SOURCE, _names, needs=(runtime.weight_type(_t), runtime.EXPERTS))
for _t in matvec.FLOAT_TYPES:
    runtime.declare(matvec.SOURCE, [f"matvec_experts_f<{_t}>"], needs=(runtime.weight_type(_t), runtime.EXPERTS))
for _t in MMA_TYPES:
    _names = [f"matvec_experts_mma<{_t}, {g}>" for g in MMA_GROUPS]
    runtime.declare(MMA_SOURCE, _names, needs=(runtime.weight_type(_t), runtime.EXPERTS))

# 1: expert tensors of skinny_gemm's types (Q4_K, Q6_K, Q8_0, whole superblocks a row) take skinny_experts at every
# width: the skinny GEMM's fp16 numbers, each pair's row one chain over its columns, its weights read once per run of
# up to 64 pairs on the fp16 tensor cores, where the int8 kernels' float work a 32-column unit bounds them at 16 and
# more pairs an expert. A layer runs one kind at every width, so either keeps a pair's bits independent of the batch.
# H200, 2026-12-05 (exp/next2 at 242a9fd, synthetic qwen3-30b-a3b Q4_K_M, on against off on one machine start): one
# layer's experts 518 against 906 us at 512 tokens, 197 against 252 at 32, 30.4 against 25.3 at 1
# (scripts/bench_moe_experts.py --fp16); prefill 14,704 against 10,320 tok/s, steps of 32 sequences 7.77 against
# 8.67 ms, batch 1 312 against 377 tok/s (bench decode); bench serve at 32 clients 3,318 against 2,704 tok/s. Batch 1
# pays ~11 us a layer; SwiGLU's conversion inside the gate + up launch measured slower (docs/performance.md).
FP16_EXPERTS = 1
FP16_RUNS = tuple(8 * ni for ni in skinny_gemm.TILE_COUNTS)  # skinny_experts' pairs a warp: 8 NI
FP16_WARPS = 4  # skinny_experts' warps a block (sk::EXPERT_WARPS), 16 rows each
for _t in skinny_gemm.TYPES:
    _names = [f"skinny_experts<{_t}, {ni}>" for ni in skinny_gemm.TILE_COUNTS]
    _names += [f"skinny_experts_combine<{_t}>"]
    runtime.declare(skinny_gemm.SOURCE, _names, needs=(runtime.weight_type(_t), runtime.EXPERTS), part="experts")

_P, _I, _L = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
_ROUTE_ARGS = (_P, _P, _P, _I, _I, _I)
_COMBINE_ARGS = (_P, _P, _P, _I, _I, _I)
_Q_ARGS = (None, _P, _I, _P, _P, _I, _I, _L)  # None: matvec.Segments by value
_GROUPED_ARGS = (None, _P, _P, _P, _I, _P, _P, _I, _I, _L)
_MMA_ARGS = (None, _P, _P, _P, _I, _P, _P, _I, _I, _I, _L)
_SORT_ARGS = (_P, _P, _P, _P, _I, _I, _I)
_ROUTER_ARGS = (_P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I)
_TILES_ARGS = (_P, _P, _P, _I, _I, _I)
_DOWN_COMBINE_ARGS = (_P, _P, _P, _P, _I, _P, _P, _I, _I, _I, _L)
_F_ARGS = (None, _P, _I, _P, _I, _L, _I)
_FP16_ARGS = (None, _P, _P, _P, _P, _I, _P, _I, _I, _I, _L)
_FP16_COMBINE_ARGS = (_P, _P, _P, _P, _I, _P, _I, _I, _I, _L)
_shared_allowed: dict[object, int] = {}  # a kernel's dynamic shared memory opted in past the default
runtime.on_reload(_shared_allowed.clear)


@dataclass(frozen=True)
class ExpertWeights:
    """An expert tensor [experts, rows, cols] on the GPU: one matrix of experts x rows GGUF rows in its stored
    encoding (never tiled), expert e's matrix from row e x rows."""

    matrix: QuantWeight
    experts: int

    @property
    def rows(self) -> int:
        return self.matrix.rows // self.experts

    @property
    def cols(self) -> int:
        return self.matrix.cols

    @property
    def ggml_type(self) -> int:
        return self.matrix.ggml_type

    @property
    def nbytes(self) -> int:
        """Every expert's encoded bytes (as the CPU backend's array of them reports)."""
        return self.matrix.nbytes

    def expert(self, e: int) -> QuantWeight:
        """Expert e's matrix alone, as a view (tests compare a pair's output with its plain mat-vec)."""
        data = self.matrix.data.rows(e * self.rows, (e + 1) * self.rows)
        return QuantWeight(data, self.ggml_type, self.rows, self.cols)


def upload(raw: np.ndarray, ggml_type: int, experts: int, rows: int, cols: int, arena=None) -> ExpertWeights:
    """An expert tensor's GGUF bytes (expert-major) onto the GPU as it is stored."""
    matrix = weight_layout.upload(raw, ggml_type, experts * rows, cols, arena, gathered=True)
    return ExpertWeights(matrix, experts)


def route(ids: DeviceTensor, weights: DeviceTensor, logits: DeviceTensor, stream: driver.Stream,
          shared: bool = False) -> None:  # fmt: skip
    """ids int32 [n, k] and weights float32 [n, k] from the router's logits float32 [n, experts]: per row the k
    most probable experts of softmax(logits), most probable first (equal probabilities: the lower id first), their
    probabilities divided by their sum. shared: the logits' last column is a shared expert's gate, not an expert's;
    the shared expert (id experts - 1) is each row's last pair, weighted sigmoid(gate) (moe.cu: ids and weights
    [n, k + 1])."""
    n, experts = logits.shape
    k = ids.shape[1] if len(ids.shape) == 2 else -1
    experts, k = experts - shared, k - shared
    if logits.dtype != np.float32 or not 1 <= k <= experts:
        raise ValueError(f"route: logits must be float32 [n, experts] and 1 <= k <= experts, got {logits.dtype} "
                         f"{logits.shape} and ids {ids.shape}")  # fmt: skip
    width = k + shared
    if (ids.dtype, ids.shape, weights.dtype, weights.shape) != (np.int32, (n, width), np.float32, (n, width)):
        raise ValueError(f"route: ids must be int32 and weights float32 [{n}, {width}], got {ids.dtype} {ids.shape} "
                         f"and {weights.dtype} {weights.shape}")  # fmt: skip
    if n:
        args = (ids.ptr, weights.ptr, logits.ptr, experts, k, int(shared))
        driver.launch(runtime.kernel(SOURCE, "moe_route"), (n,), (32,), args, _ROUTE_ARGS, stream, 4 * experts,
                      pdl=True)  # fmt: skip


def router(logits: DeviceTensor, h: DeviceTensor, weight: QuantWeight, stream: driver.Stream,
           routed: tuple[DeviceTensor, DeviceTensor] | None = None, shared: bool = False) -> None:  # fmt: skip
    """logits float32 [n, experts] = h float32 [n, hidden] @ weight^T for a float32 router [experts, hidden], each
    row the same bits at every n (moe.cu's moe_router; from ROUTER_TILES_MIN_TOKENS rows moe_router_tiles, its
    expression by tiles). routed: (ids, weights) as route() writes them (with
    `shared`, as route(..., shared=True)), in the same launch (n <= ROUTER_WARPS)."""
    n, hidden = h.shape
    experts = weight.rows
    if weight.ggml_type != 0 or weight.cols != hidden or hidden % 4 or weight.data.ptr % 16 or h.ptr % 16 or (
            weight.data.shape[1] != 4 * hidden):  # fmt: skip
        raise ValueError(f"router: a float32 router [experts, {hidden}] with 16-byte aligned rows and h "
                         f"(hidden % 4 == 0), got type {weight.ggml_type} [{weight.rows}, {weight.cols}]")  # fmt: skip
    if logits.dtype != np.float32 or logits.shape != (n, experts) or h.dtype != np.float32:
        raise ValueError(f"router: h and logits float32 [{n}, {experts}], got {h.dtype} and {logits.dtype} "
                         f"{logits.shape}")  # fmt: skip
    ids = weights = None
    smem = 0
    if routed is not None:
        ids, weights = routed
        width = ids.shape[1] if len(ids.shape) == 2 else -1
        shapes = (ids.dtype, ids.shape, weights.dtype, weights.shape)
        if n > ROUTER_WARPS or not 1 <= width - shared <= experts - shared or shapes != (
                np.int32, (n, width), np.float32, (n, width)):  # fmt: skip
            raise ValueError(f"router: routes up to {ROUTER_WARPS} rows into int32 ids and float32 weights [n, k], "
                             f"got {n} rows, ids {ids.dtype} {ids.shape}, weights {weights.shape}")  # fmt: skip
        smem = 4 * ROUTER_WARPS * experts
    if n == 0:
        return
    if routed is None and n >= ROUTER_TILES_MIN_TOKENS:
        grid = (-(-experts // ROUTER_TILE), -(-n // ROUTER_TILE))
        args = (logits.ptr, h.ptr, weight.data.ptr, n, hidden, experts)
        fn = runtime.kernel(SOURCE, "moe_router_tiles")
        driver.launch(fn, grid, (32 * ROUTER_WARPS,), args, _TILES_ARGS, stream, pdl=True)
        return
    k = 0 if ids is None else ids.shape[1] - shared
    args = (logits.ptr, 0 if ids is None else ids.ptr, 0 if weights is None else weights.ptr, h.ptr, weight.data.ptr,
            n, hidden, experts, k, int(routed is not None), int(shared))  # fmt: skip
    fn = runtime.kernel(SOURCE, "moe_router")
    _allow_shared(fn, smem)
    driver.launch(fn, (experts, -(-n // ROUTER_TOKENS)), (32 * ROUTER_WARPS,), args, _ROUTER_ARGS, stream, smem,
                  pdl=True)  # fmt: skip


def expert_matvec(outs: list[DeviceTensor], mats: list[ExpertWeights], ids: DeviceTensor, per_token: int,
                  stream: driver.Stream, x: DeviceTensor | None = None, quantized=None) -> None:  # fmt: skip
    """outs[i] [pairs, rows] float32: row p = activation row p // per_token @ dequant(expert ids[p] of mats[i])^T,
    for one or two expert tensors of one type, shape and encoding (gate and up) in one launch. The activation:
    quantized (matvec's format, for block formats) or x float32 (float weights), of pairs / per_token rows."""
    first = mats[0]
    t, rows, cols, row_bytes = first.ggml_type, first.rows, first.cols, first.matrix.data.shape[1]
    pairs = ids.numel
    if error := _check(outs, mats, ids, per_token, x, quantized):
        raise ValueError(f"expert_matvec: {error}")
    if pairs == 0:
        return
    seg = matvec.segments(outs, [m.matrix for m in mats], [None] * len(mats))
    for i in range(len(mats)):
        seg.rows[i] = rows
    rpw = 2 if t in matvec.FLOAT_TYPES else PAIR_RPW  # matvec_experts_f's two rows a warp
    warps = len(mats) * -(-rows // rpw)
    per_block = min(MAX_WARPS, warps)
    grid, block = (pairs, -(-warps // per_block)), (32 * per_block,)
    if t in matvec.FLOAT_TYPES:
        vec = int(x.ptr % 16 == 0 and first.matrix.data.ptr % 16 == 0 and row_bytes % 16 == 0 and cols % 4 == 0)
        args = (seg, ids.ptr, per_token, x.ptr, cols, row_bytes, vec)
        fn = runtime.kernel(matvec.SOURCE, f"matvec_experts_f<{t}>")
        driver.launch(fn, grid, block, args, _F_ARGS, stream, pdl=True)
    else:
        xq, xs = quantized[0], quantized[1]
        args = (seg, ids.ptr, per_token, xq.ptr, xs.ptr, xq.shape[1], cols, row_bytes)
        fn = runtime.kernel(matvec.SOURCE, f"matvec_experts<{t}, {PAIR_RPW}>")
        driver.launch(fn, grid, block, args, _Q_ARGS, stream, pdl=True)


class Grouping(NamedTuple):
    """moe_sort's output: the pairs by expert (order int32 [pairs]), runs of at most `run` pairs of one expert
    (groups int32 [max_groups(pairs, experts, run), 4]: expert, first index into order, count, 0) and their number
    (num_groups int32 [1]). run: GROUP_TOKENS for matvec_experts_grouped, one of MMA_GROUPS for
    matvec_experts_mma."""

    order: DeviceTensor
    groups: DeviceTensor
    num_groups: DeviceTensor
    run: int


class ExpertMats(ctypes.Structure):
    """moe_mma.cu's xm::ExpertMats: the one or two matrices of a launch and their outputs, passed by value."""

    _fields_ = [("weight", _P * 2), ("out", _P * 2)]


def _allow_shared(fn, shared: int) -> None:
    """Opt fn in to `shared` bytes of dynamic shared memory (moe_sort and the routing moe_router keep 16 bytes an
    expert; matvec_experts_mma's two stages). Past 32 KiB it always asks: the 48 KiB a launch may take unasked
    includes the kernel's static shared memory (matvec_experts_mma's Q6_K stages of 16 pairs, 48 KiB exactly, failed
    to launch with CUDA_ERROR_INVALID_VALUE on the H200)."""
    if shared > _shared_allowed.get(fn, 32 << 10):
        driver.set_max_dynamic_shared(fn, shared)
        _shared_allowed[fn] = shared


def max_groups(pairs: int, experts: int, run: int) -> int:
    """The most groups moe_sort can make: each chosen expert's pairs in runs of `run`, the last one short."""
    return -(-pairs // run) + min(experts, pairs)


def sort(grouping: Grouping, ids: DeviceTensor, experts: int, stream: driver.Stream) -> None:
    """Group the (token, rank) pairs of ids (int32 [n, k] or [pairs], expert ids < experts) by expert."""
    pairs = ids.numel
    order, groups, num_groups, _ = grouping
    if not 1 <= experts <= MAX_EXPERTS or ids.dtype != np.int32:
        raise ValueError(f"sort: int32 ids of 1..{MAX_EXPERTS} experts, got {ids.dtype} and {experts} experts")
    shapes = (order.shape, groups.shape, num_groups.shape)
    most = max_groups(pairs, experts, max(grouping.run, 1))
    if grouping.run < 1 or shapes != ((pairs,), (most, 4), (1,)) or any(t.dtype != np.int32 for t in grouping[:3]):
        raise ValueError(f"sort: runs of at least 1 pair, order int32 [{pairs}], groups int32 [{most}, 4] and "
                         f"num_groups int32 [1], got run {grouping.run} and {shapes}")  # fmt: skip
    args = (order.ptr, groups.ptr, num_groups.ptr, ids.ptr, pairs, experts, grouping.run)
    fn = runtime.kernel(SOURCE, "moe_sort")
    _allow_shared(fn, 16 * experts)
    driver.launch(fn, (1,), (SORT_THREADS,), args, _SORT_ARGS, stream, 16 * experts, pdl=True)


def grouped_matvec(outs: list[DeviceTensor], mats: list[ExpertWeights], grouping: Grouping, per_token: int,
                   stream: driver.Stream, quantized) -> None:  # fmt: skip
    """expert_matvec's outputs (block formats only), from the pairs grouped by sort: each chosen expert's rows are
    read once per group of its pairs, grouping.run at most: matvec_experts_grouped's GROUP_TOKENS, or one of
    MMA_GROUPS on the tensor cores (MMA_TYPES). Bitwise what expert_matvec gives every pair."""
    first = mats[0]
    if first.ggml_type not in matvec.QUANT_TYPES:
        raise ValueError(f"grouped_matvec: block formats only, got type {first.ggml_type}")
    if error := _check(outs, mats, grouping.order, per_token, None, quantized):
        raise ValueError(f"grouped_matvec: {error}")
    pairs = grouping.order.numel
    if pairs == 0:
        return
    if grouping.run != GROUP_TOKENS:
        _grouped_mma(outs, mats, grouping, per_token, stream, quantized)
        return
    seg = matvec.segments(outs, [m.matrix for m in mats], [None] * len(mats))
    for i in range(len(mats)):
        seg.rows[i] = first.rows
    warps = len(mats) * -(-first.rows // GROUP_RPW)
    per_block = min(MAX_WARPS, warps)
    grid = (grouping.groups.shape[0], -(-warps // per_block))
    xq, xs = quantized[0], quantized[1]
    args = (seg, grouping.order.ptr, grouping.groups.ptr, grouping.num_groups.ptr, per_token, xq.ptr, xs.ptr,
            xq.shape[1], first.cols, first.matrix.data.shape[1])  # fmt: skip
    fn = runtime.kernel(matvec.SOURCE, f"matvec_experts_grouped<{first.ggml_type}, {GROUP_TOKENS}, {GROUP_RPW}>")
    driver.launch(fn, grid, (32 * per_block,), args, _GROUPED_ARGS, stream, pdl=True)


_MMA_PIECES = {12: 9, 13: 11, 14: 14, 8: 17}  # 16-byte pieces matvec_experts_mma stages a (stage, row): mu::Policy
_MMA_RAW = {14: 224, 8: 288}  # a row's raw window (2-byte aligned stages, copied as the 16-byte chunks holding them)


def mma_shared(ggml_type: int, group: int, cols: int) -> int:
    """matvec_experts_mma's dynamic shared memory: two buffers of a stage (256 columns), each with the pairs'
    activations and scales (640 bytes a pair) and the rows' weights (the format's pieces a row, and for Q4_K / Q5_K
    each unit's {A, B}: 64 bytes), and for Q6_K / Q8_0 one raw window a row."""
    rows = 16 * MMA_WARPS // (group // 16)
    buffer = 640 * group + 16 * _MMA_PIECES[ggml_type] * rows + (64 * rows if ggml_type in (12, 13) else 0)
    return 2 * buffer + _MMA_RAW.get(ggml_type, 0) * rows


def _grouped_mma(outs, mats, grouping: Grouping, per_token: int, stream: driver.Stream, quantized) -> None:
    """grouped_matvec on matvec_experts_mma (arguments checked by grouped_matvec)."""
    first, group = mats[0], grouping.run
    if first.ggml_type not in MMA_TYPES or group not in MMA_GROUPS:
        raise ValueError(f"grouped_matvec: runs other than GROUP_TOKENS ({GROUP_TOKENS}) take the tensor cores: "
                         f"types {MMA_TYPES}, runs {MMA_GROUPS}; got type {first.ggml_type}, run {group}")  # fmt: skip
    if grouping.groups.shape[0] > 65535:
        raise ValueError(f"grouped_matvec: {grouping.groups.shape[0]} groups exceed the launch's grid (65535)")
    rows = first.rows
    mats_arg = ExpertMats()
    for i, (out, m) in enumerate(zip(outs, mats, strict=True)):
        mats_arg.weight[i], mats_arg.out[i] = m.matrix.data.ptr, out.ptr
    tiles = -(-rows // (16 * MMA_WARPS // (group // 16)))
    xq, xs = quantized[0], quantized[1]
    args = (mats_arg, grouping.order.ptr, grouping.groups.ptr, grouping.num_groups.ptr, per_token, xq.ptr, xs.ptr,
            xq.shape[1], rows, first.cols, first.matrix.data.shape[1])  # fmt: skip
    fn = runtime.kernel(MMA_SOURCE, f"matvec_experts_mma<{first.ggml_type}, {group}>")
    shared = mma_shared(first.ggml_type, group, first.cols)
    _allow_shared(fn, shared)
    driver.launch(fn, (tiles * len(mats), grouping.groups.shape[0]), (32 * MMA_WARPS,), args, _MMA_ARGS, stream,
                  shared, pdl=True)  # fmt: skip


def fp16_takes(mats: list[ExpertWeights]) -> bool:
    """Whether skinny_experts runs these expert tensors (with FP16_EXPERTS on): all of skinny_gemm's types, whole
    superblocks a row."""
    return bool(FP16_EXPERTS) and all(
        m.ggml_type in skinny_gemm.TYPES and m.cols % skinny_gemm.SUPERBLOCK[m.ggml_type] == 0 for m in mats
    )


def fp16_run(pairs: int, experts: int) -> int:
    """The run moe_sort cuts for skinny_experts: the fewest pairs a warp (8 NI) that hold an expert's average share
    of the pairs. Any run gives the same bits; this only moves time."""
    share = -(-pairs // max(1, min(experts, pairs)))
    return next((r for r in FP16_RUNS if r >= share), FP16_RUNS[-1])


def fp16_experts(outs: list[DeviceTensor], mats: list[ExpertWeights], per_token: int, xa: DeviceTensor,
                 stream: driver.Stream, grouping: Grouping | None = None,
                 ids: DeviceTensor | None = None) -> None:  # fmt: skip
    """outs[i] [pairs, rows] float32: row p = activation row p // per_token @ dequant(expert of pair p)^T on
    skinny_experts, for one or two expert tensors of one type and shape (gate and up) in one launch. xa: the
    activation rows as skinny_gemm.convert writes them (activation_rows_shape). The pairs: grouped by sort (runs
    of one of FP16_RUNS), or ids int32 [pairs] with each pair its own group (no sort). A pair's row is the same bits
    either way and in any run."""
    first = mats[0]
    t, rows, cols = first.ggml_type, first.rows, first.cols
    if not 1 <= len(mats) <= 2 or len(outs) != len(mats) or (grouping is None) == (ids is None):
        raise ValueError("fp16_experts: one or two expert tensors with an out each, and either a grouping or ids")
    if any((m.ggml_type, m.rows, m.cols, m.experts) != (t, rows, cols, first.experts) for m in mats):
        raise ValueError("fp16_experts: one launch takes expert tensors of one type and shape")
    if t not in skinny_gemm.TYPES or cols % skinny_gemm.SUPERBLOCK[t] or any(m.matrix.tiled for m in mats):
        raise ValueError(f"fp16_experts: no kernel for type {t} with {cols} columns (or a tiled expert tensor)")
    pairs = (grouping.order if grouping is not None else ids).numel
    act_rows = -(-pairs // per_token) if per_token > 0 else -1
    want = skinny_gemm.activation_rows_shape(act_rows, cols)
    if per_token < 1 or pairs % per_token or xa.dtype != np.uint32 or xa.shape != want:
        raise ValueError(f"fp16_experts: xa must be uint32 {want} for {pairs} pairs at {per_token} a row; got "
                         f"{xa.dtype} {xa.shape}")  # fmt: skip
    if any(o.dtype != np.float32 or o.shape != (pairs, rows) for o in outs):
        raise ValueError(f"fp16_experts: outs must be float32 [{pairs}, {rows}]")
    if grouping is not None and grouping.run not in FP16_RUNS:
        raise ValueError(f"fp16_experts: runs of {FP16_RUNS} pairs, got {grouping.run}")
    if pairs == 0:
        return
    mats_arg = ExpertMats()
    for i, (out, m) in enumerate(zip(outs, mats, strict=True)):
        mats_arg.weight[i], mats_arg.out[i] = m.matrix.data.ptr, out.ptr
    ni = grouping.run // 8 if grouping is not None else 1
    blocks_y = grouping.groups.shape[0] if grouping is not None else pairs
    if blocks_y > 65535:
        raise ValueError(f"fp16_experts: {blocks_y} groups exceed the launch's grid (65535)")
    tiles = -(-act_rows // 8)
    if grouping is not None:
        pointers = (0, grouping.order.ptr, grouping.groups.ptr, grouping.num_groups.ptr)
    else:
        pointers = (ids.ptr, 0, 0, 0)
    args = (mats_arg, *pointers, per_token, xa.ptr, tiles, rows, cols, first.matrix.data.shape[1])
    fn = runtime.kernel(skinny_gemm.SOURCE, f"skinny_experts<{t}, {ni}>")
    grid = (-(-rows // (16 * FP16_WARPS)) * len(mats), blocks_y)
    driver.launch(fn, grid, (32 * FP16_WARPS,), args, _FP16_ARGS, stream, pdl=True)


def fp16_down_combine(out: DeviceTensor, down: ExpertWeights, ids: DeviceTensor, weights: DeviceTensor,
                      xa: DeviceTensor, stream: driver.Stream) -> None:  # fmt: skip
    """combine's out [n, rows] of fp16_experts' down rows (each pair its own group) in one launch: each pair's row
    the bits fp16_experts gives it, then combine's sum (skinny_experts_combine; k <= COMBINE_MAX_K)."""
    n, rows = out.shape
    k = weights.shape[1] if len(weights.shape) == 2 else 0
    t, cols = down.ggml_type, down.cols
    if not 1 <= k <= COMBINE_MAX_K or weights.shape != (n, k) or ids.numel != n * k or ids.dtype != np.int32:
        raise ValueError(f"fp16_down_combine: ids int32 [n k] and weights [n, k] for 1 <= k <= {COMBINE_MAX_K}, got "
                         f"{ids.shape} and {weights.shape}")  # fmt: skip
    if t not in skinny_gemm.TYPES or cols % skinny_gemm.SUPERBLOCK[t] or down.matrix.tiled or rows != down.rows:
        raise ValueError(f"fp16_down_combine: no kernel for type {t}, [{down.rows}, {cols}] into {out.shape}")
    want = skinny_gemm.activation_rows_shape(n * k, cols)
    if out.dtype != np.float32 or weights.dtype != np.float32 or xa.shape != want:
        raise ValueError(f"fp16_down_combine: float32 out and weights, xa {want}")
    if n == 0:
        return
    args = (out.ptr, down.matrix.data.ptr, ids.ptr, weights.ptr, k, xa.ptr, -(-n * k // 8), rows, cols,
            down.matrix.data.shape[1])  # fmt: skip
    fn = runtime.kernel(skinny_gemm.SOURCE, f"skinny_experts_combine<{t}>")
    driver.launch(fn, (-(-rows // 16), n), (32 * min(k, skinny_gemm.WARPS),), args, _FP16_COMBINE_ARGS, stream,
                  pdl=True)  # fmt: skip


def _check(outs, mats, ids, per_token, x, quantized) -> str | None:
    """What is wrong with expert_matvec's arguments, or None."""
    if not 1 <= len(mats) <= 2 or len(outs) != len(mats):
        return f"{len(mats)} expert tensors and {len(outs)} outs; one launch takes one or two of each"
    first = mats[0]
    shape = (first.ggml_type, first.rows, first.cols, first.matrix.data.shape[1], first.matrix.tiled)
    if any((m.ggml_type, m.rows, m.cols, m.matrix.data.shape[1], m.matrix.tiled) != shape for m in mats):
        return "the expert tensors of one launch must share type, shape and encoding"
    if first.matrix.tiled or first.matrix.layout_error(matvec.FLOAT_TYPES + matvec.QUANT_TYPES) is not None:
        return f"expert tensor: {first.matrix.layout_error(matvec.FLOAT_TYPES + matvec.QUANT_TYPES) or 'tiled'}"
    pairs, rows = ids.numel, first.rows
    if ids.dtype != np.int32 or per_token < 1 or pairs % per_token:
        return f"ids must be int32 [pairs], pairs a multiple of per_token {per_token}: got {ids.dtype} {ids.shape}"
    if -(-len(mats) * -(-rows // 2) // MAX_WARPS) > 65535:
        return f"{rows} rows exceed the launch's grid"
    for out in outs:
        if out.dtype != np.float32 or out.shape != (pairs, rows):
            return f"out must be float32 [{pairs}, {rows}], got {out.dtype} {out.shape}"
    act_rows = pairs // per_token
    if first.ggml_type in matvec.FLOAT_TYPES:
        if x is None or x.dtype != np.float32 or x.shape != (act_rows, first.cols):
            return f"float weights read x float32 [{act_rows}, {first.cols}]"
        return None
    if quantized is None:
        return "block formats read the activation quantized"
    try:
        matvec.check_activation(quantized, act_rows, first.cols)
    except ValueError as e:
        return str(e)
    if len(quantized) > 2 and quantized[2] is not None:
        return "an activation with a deferred RMSNorm is read by the tensor-core mat-vecs only"
    return None


def down_combine(out: DeviceTensor, down: ExpertWeights, ids: DeviceTensor, weights: DeviceTensor, quantized,
                 stream: driver.Stream) -> None:  # fmt: skip
    """combine(out, y, weights) of y = expert_matvec([down], ids, per_token 1) in one launch, bitwise: each token's
    k pairs' rows computed side by side (a warp a pair) and added in rank order. quantized: the pairs' activations
    (n k rows, matvec's format); block formats and k <= COMBINE_MAX_K."""
    n, k = ids.shape if len(ids.shape) == 2 else (0, 0)
    if down.ggml_type not in matvec.QUANT_TYPES or not 1 <= k <= COMBINE_MAX_K:
        raise ValueError(f"down_combine: block formats and 1..{COMBINE_MAX_K} experts a token, got type "
                         f"{down.ggml_type} and ids {ids.shape}")  # fmt: skip
    if ids.dtype != np.int32 or down.matrix.tiled or down.matrix.layout_error(matvec.QUANT_TYPES) is not None:
        raise ValueError(f"down_combine: int32 ids and an untiled expert tensor, got {ids.dtype}")
    if (out.dtype, out.shape, weights.dtype, weights.shape) != (np.float32, (n, down.rows), np.float32, (n, k)):
        raise ValueError(f"down_combine: out float32 [{n}, {down.rows}] and weights float32 [{n}, {k}], got "
                         f"{out.dtype} {out.shape} and {weights.dtype} {weights.shape}")  # fmt: skip
    matvec.check_activation(quantized, n * k, down.cols)
    if n:
        xq, xs = quantized[0], quantized[1]
        args = (out.ptr, down.matrix.data.ptr, ids.ptr, weights.ptr, k, xq.ptr, xs.ptr, n * k, down.rows, down.cols,
                down.matrix.data.shape[1])  # fmt: skip
        fn = runtime.kernel(matvec.SOURCE, f"matvec_experts_combine<{down.ggml_type}, {COMBINE_RPW}>")
        driver.launch(fn, (n, -(-down.rows // COMBINE_RPW)), (32 * k,), args, _DOWN_COMBINE_ARGS, stream, pdl=True)


def combine(out: DeviceTensor, y: DeviceTensor, weights: DeviceTensor, stream: driver.Stream) -> None:
    """out [n, cols] = sum over r in rank order of weights[t, r] * y[t k + r] (y float32 [n k, cols], weights
    float32 [n, k]), each product rounded and added in turn as numpy does."""
    n, cols = out.shape
    k = weights.shape[1] if len(weights.shape) == 2 else 0
    f32 = all(t.dtype == np.float32 for t in (out, y, weights))
    if not f32 or k < 1 or weights.shape != (n, k) or y.shape != (n * k, cols):
        raise ValueError(f"combine: out [n, cols], weights [n, k] and y [n k, cols] float32, got {out.shape}, "
                         f"{weights.shape} and {y.shape}")  # fmt: skip
    if n and cols:
        driver.launch(runtime.kernel(SOURCE, "moe_combine"), (-(-n * cols // THREADS),), (THREADS,),
                      (out.ptr, y.ptr, weights.ptr, n, k, cols), _COMBINE_ARGS, stream, pdl=True)  # fmt: skip
