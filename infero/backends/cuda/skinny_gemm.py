"""Skinny GEMM for decode steps of a few sequences (Q4_K, Q6_K, Q8_0): out[n, rows] = x[n, cols] @ W.T (+ bias).

`convert` writes x (float32) as fp16 in the column order the weight type's kernel consumes (one conversion serves
every matrix of that type reading x), then `skinny_gemm` streams the weights once for all n <= MAX_TOKENS tokens
on the tensor cores, splitting k over blocks where the row tiles alone leave SMs idle, the splits' partial sums
added by a second kernel (kernels/skinny_gemm.cu says how). A row's result does not depend on n or the token's
position in the batch. `skinny_gemv` computes the same bits for up to GEMV_MAX_TOKENS tokens, streamed as a
mat-vec streams (every warp on its own, several superblocks in flight, the splits summed inside the block).
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np

from infero.backends.cuda import driver, runtime
from infero.backends.cuda.tensor import DeviceTensor, QuantWeight, Workspace
from infero.checkpoint.tensor_types import GGMLType

SOURCE = "skinny_gemm.cu"
TYPES = (int(GGMLType.Q4_K), int(GGMLType.Q6_K), int(GGMLType.Q8_0))
TILE_COUNTS = (1, 2, 4, 8)  # 8-token MMA tiles per launch: the kernel's NI
MAX_TOKENS = 8 * TILE_COUNTS[-1]
# Mirroring Fmt<T> in skinny_gemm.cu: columns per superblock (the unit of a split) and rows per warp.
SUPERBLOCK = {int(GGMLType.Q4_K): 256, int(GGMLType.Q6_K): 256, int(GGMLType.Q8_0): 128}
ROWS_PER_WARP = {int(GGMLType.Q4_K): 32, int(GGMLType.Q6_K): 16, int(GGMLType.Q8_0): 32}
WARPS = 8
MAX_SPLITS = 16
_THREADS = 256
GEMV_MAX_TOKENS = 8  # one 8-token MMA tile
GEMV_SEGMENTS = 3  # matrices a skinny_gemv launch takes (sk::GEMV_SEGMENTS)
_GEMV_WARPS = 8  # warps a block aims at: row tiles x splits
_GEMV_MAX_WARPS = {int(GGMLType.Q4_K): 16, int(GGMLType.Q6_K): 8, int(GGMLType.Q8_0): 16}  # Gemv<T>::MAX_WARPS

runtime.declare(SOURCE, ["skinny_reduce"])
for _t in TYPES:
    # skinny_gemv (and its GLU form) and the SwiGLU conversion with them (~0.8 s of the unit's compile):
    # ops.SKINNY_GEMV switches to them between graph captures, and the MoE's fp16 experts convert with the latter.
    runtime.declare(SOURCE, [f"skinny_x_to_f16<{_t}>", f"skinny_swiglu_to_f16<{_t}>", f"skinny_gemv<{_t}>",
                             f"skinny_gemv<{_t}, true>"] + [f"skinny_gemm<{_t}, {ni}>" for ni in TILE_COUNTS],
                    needs=(runtime.weight_type(_t),))  # fmt: skip

_P, _I = ctypes.c_void_p, ctypes.c_int
_GEMM_ARG_TYPES = (_P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I)
_CONVERT_ARG_TYPES = (_P, _P, _I, _I, _I)
_SWIGLU_ARG_TYPES = (_P, _P, _P, _I, _I, _I, _P)
_REDUCE_ARG_TYPES = (_P, _P, _P, _I, _I, _I)
_GEMV_ARG_TYPES = (None, _P, _I, _I, _P, _I)  # None: GemvSegments by value
_functions: dict[tuple[int, int], object] = {}  # (type, NI) -> CUfunction with its shared-memory limit raised
runtime.on_reload(_functions.clear)
_num_sms: list[int] = []


def supports(weight: QuantWeight, n: int) -> bool:
    return weight.ggml_type in TYPES and 0 < n <= MAX_TOKENS and weight.cols % SUPERBLOCK[weight.ggml_type] == 0


def tiles(n: int) -> int:
    """The kernel's NI for n tokens: 8-token tiles, rounded up to an instantiated count."""
    if not 0 < n <= MAX_TOKENS:
        raise ValueError(f"skinny_gemm: {n} tokens; it takes 1 to {MAX_TOKENS}")
    return next(t for t in TILE_COUNTS if 8 * t >= n)


def activation_rows_shape(rows: int, cols: int) -> tuple[int, int]:
    """convert's rows_layout: any number of activation rows in ceil(rows / 8) tiles (the expert kernels', each
    lane loading its own row's fragments)."""
    return (cols // 32 * -(-rows // 8) * 32, 4)


def activation_shape(n: int, cols: int) -> tuple[int, int]:
    """x for `n` tokens in the kernel's layout: uint32 [slots, 4], 16 bytes per (superblock, word, tile, lane); a
    word is 8 columns of each of 4 lanes, whatever the type."""
    return (cols // 32 * tiles(n) * 32, 4)


def block_rows(ggml_type: int) -> int:
    return WARPS * ROWS_PER_WARP[ggml_type]


@functools.lru_cache(maxsize=1024)
def splits(ggml_type: int, rows: int, cols: int, num_sms: int) -> int:
    """Contiguous k ranges per row tile: the fewest superblocks per block in the fewest waves (one block per SM;
    each split costs a partial-sum round trip, counted as a quarter superblock). From the shape only, never n; at
    most one split per superblock (the kernel relies on every split holding one)."""
    row_tiles = -(-rows // block_rows(ggml_type))
    superblocks = cols // SUPERBLOCK[ggml_type]

    def cost(s: int) -> float:
        return -(-row_tiles * s // num_sms) * -(-superblocks // s) + 0.25 * (s - 1)

    return min(range(1, min(MAX_SPLITS, superblocks) + 1), key=cost)


def shared_bytes(ggml_type: int, n: int) -> int:
    """Dynamic shared memory of skinny_gemm<ggml_type, tiles(n)>: two superblocks of activations."""
    return 2 * (SUPERBLOCK[ggml_type] // 32) * tiles(n) * 32 * 16


def _gemm_function(ggml_type: int, n: int):
    key = (ggml_type, tiles(n))
    fn = _functions.get(key)
    if fn is None:
        fn = _functions[key] = runtime.kernel(SOURCE, f"skinny_gemm<{ggml_type}, {tiles(n)}>")
        driver.set_max_dynamic_shared(fn, shared_bytes(ggml_type, n))
    return fn


def _sms() -> int:
    if not _num_sms:
        _num_sms.append(runtime.context().info.num_sms)
    return _num_sms[0]


def convert(xa: DeviceTensor, x: DeviceTensor, ggml_type: int, stream: driver.Stream, rows_layout: bool = False,
            up: DeviceTensor | None = None, out: DeviceTensor | None = None) -> None:  # fmt: skip
    """xa (activation_shape) = x float32 [n, cols] as fp16 in ggml_type's column order, padding tokens zero.
    rows_layout: any n, in ceil(n / 8) tiles (activation_rows_shape: the expert kernels' activation rows).
    up: x is SwiGLU's gate and up its up projection (float32 [n, cols]): xa holds silu(x) * up, and out (if
    given, float32 [n, cols]) the same in float32."""
    n, cols = x.shape
    count = -(-n // 8) if rows_layout else (tiles(n) if 0 < n <= MAX_TOKENS else 0)
    if ggml_type not in TYPES or cols % SUPERBLOCK[ggml_type] or not 0 < count < (1 << 16):
        raise ValueError(f"skinny_gemm.convert: no layout for type {ggml_type}, [{n}, {cols}]")
    shape = activation_rows_shape(n, cols) if rows_layout else activation_shape(n, cols)
    if x.dtype != np.float32 or x.ptr % 16 or xa.shape != shape or xa.dtype != np.uint32:
        raise ValueError(f"skinny_gemm.convert: x {x.dtype} {x.shape} / xa {xa.dtype} {xa.shape} do not match")
    for name, t in (("up", up), ("out", out)):
        if t is not None and (t.dtype != np.float32 or t.shape != x.shape or t.ptr % 16):
            raise ValueError(f"skinny_gemm.convert: {name} must be float32 {x.shape}, 16-byte aligned; got {t.shape}")
    if out is not None and up is None:
        raise ValueError("skinny_gemm.convert: out is SwiGLU's float output; it needs up")
    slots = xa.shape[0]
    if up is None:
        fn, args = runtime.kernel(SOURCE, f"skinny_x_to_f16<{ggml_type}>"), (xa.ptr, x.ptr, n, cols, count)
        types = _CONVERT_ARG_TYPES
    else:
        fn = runtime.kernel(SOURCE, f"skinny_swiglu_to_f16<{ggml_type}>")
        args = (xa.ptr, x.ptr, up.ptr, n, cols, count, out.ptr if out is not None else 0)
        types = _SWIGLU_ARG_TYPES
    driver.launch(fn, (-(-slots // _THREADS),), (_THREADS,), args, types, stream, pdl=True)


def skinny_gemm(
    out: DeviceTensor,
    weight: QuantWeight,
    xa: DeviceTensor,
    bias: DeviceTensor | None,
    stream: driver.Stream,
    workspace: Workspace,
) -> None:
    """out[n, rows] (float32) = x @ weight.T + bias, x given as `convert` wrote it for weight's type."""
    n, rows, cols = out.shape[0], weight.rows, weight.cols
    _check(out, weight, xa, bias)
    s = splits(weight.ggml_type, rows, cols, _sms())
    row_tiles = -(-rows // block_rows(weight.ggml_type))
    bias_ptr = bias.ptr if bias is not None else 0
    mark = workspace.offset  # the partial sums are scratch, handed back after the launches (stream order)
    part = workspace.empty((s, n, rows), np.float32) if s > 1 else out
    args = (out.ptr, part.ptr, weight.data.ptr, xa.ptr, bias_ptr, n, rows, cols, weight.data.shape[1], s,
            int(weight.tiled))  # fmt: skip
    driver.launch(_gemm_function(weight.ggml_type, n), (row_tiles * s,), (_THREADS,), args, _GEMM_ARG_TYPES,
                  stream, shared=shared_bytes(weight.ggml_type, n), pdl=True)  # fmt: skip
    if s > 1:
        reduce = runtime.kernel(SOURCE, "skinny_reduce")
        driver.launch(reduce, (-(-n * rows // _THREADS),), (_THREADS,), (out.ptr, part.ptr, bias_ptr, n, rows, s),
                      _REDUCE_ARG_TYPES, stream, pdl=True)  # fmt: skip
    workspace.offset = mark


def gemv_blocks(ggml_type: int, rows: int, splits: int) -> tuple[int, int, int]:
    """skinny_gemv's (blocks, row tiles a block, splits a block): a block's warps are row tiles x splits, all of
    a row's splits in one block (summed there) where they fit, else one split a warp through `part`."""
    if splits <= _GEMV_MAX_WARPS[ggml_type]:
        per_block, splits_per_block = max(1, _GEMV_WARPS // splits), splits
    else:
        per_block, splits_per_block = _GEMV_WARPS, 1
    row_tiles = -(-rows // 16)
    row_blocks = -(-row_tiles // per_block)
    return row_blocks * (splits // splits_per_block), per_block, splits_per_block


def skinny_gemv(
    out: DeviceTensor,
    weight: QuantWeight,
    xa: DeviceTensor,
    bias: DeviceTensor | None,
    stream: driver.Stream,
    workspace: Workspace,
) -> None:
    """skinny_gemm's out, bitwise, for up to GEMV_MAX_TOKENS tokens: x as `convert` wrote it for weight's type."""
    skinny_gemv_many([out], [weight], xa, [bias], stream, workspace)


class GemvSegments(ctypes.Structure):
    """skinny_gemm.cu's sk::GemvSegments, passed by value to skinny_gemv (unused segments: blocks 0)."""

    _fields_ = [(name, _P * GEMV_SEGMENTS) for name in ("weight", "out", "bias", "part")] + [
        (name, _I * GEMV_SEGMENTS)
        for name in ("rows", "row_bytes", "splits", "tiles_per_block", "splits_per_block", "tiled", "blocks")
    ]


def skinny_gemv_many(
    outs: list[DeviceTensor],
    weights: list[QuantWeight],
    xa: DeviceTensor,
    biases: list[DeviceTensor | None],
    stream: driver.Stream,
    workspace: Workspace,
) -> None:
    """skinny_gemv of 1 to GEMV_SEGMENTS matrices of one type and width on the same x (q/k/v, gate and up) in one
    launch, each matrix split and summed as alone (and bitwise skinny_gemm's)."""
    if not 0 < len(weights) <= GEMV_SEGMENTS or len(outs) != len(weights) or len(biases) != len(weights):
        raise ValueError(f"skinny_gemv: 1 to {GEMV_SEGMENTS} matrices with an out and a bias each, got {len(weights)}")
    ggml_type, cols, n = weights[0].ggml_type, weights[0].cols, outs[0].shape[0]
    if n > GEMV_MAX_TOKENS:
        raise ValueError(f"skinny_gemv: {n} tokens; it takes 1 to {GEMV_MAX_TOKENS}")
    for out, weight, bias in zip(outs, weights, biases, strict=True):
        if weight.ggml_type != ggml_type or weight.cols != cols or out.shape[0] != n:
            raise ValueError("skinny_gemv: one launch takes matrices of one type and width, for one activation")
        _check(out, weight, xa, bias)
    seg, blocks, warps, reduced = GemvSegments(), 0, 1, []
    mark = workspace.offset
    for i, (out, weight, bias) in enumerate(zip(outs, weights, biases, strict=True)):
        s = splits(ggml_type, weight.rows, cols, _sms())
        count, per_block, splits_per_block = gemv_blocks(ggml_type, weight.rows, s)
        seg.weight[i], seg.out[i], seg.rows[i], seg.row_bytes[i] = (weight.data.ptr, out.ptr, weight.rows,
                                                                    weight.data.shape[1])  # fmt: skip
        seg.splits[i], seg.tiles_per_block[i], seg.splits_per_block[i] = s, per_block, splits_per_block
        seg.tiled[i], seg.blocks[i] = int(weight.tiled), count
        if bias is not None:
            seg.bias[i] = bias.ptr
        if splits_per_block < s:
            part = workspace.empty((s, n, weight.rows), np.float32)
            seg.part[i] = part.ptr
            reduced.append((out, part, bias, weight.rows, s))
        blocks += count
        warps = max(warps, per_block * splits_per_block)
    fn = runtime.kernel(SOURCE, f"skinny_gemv<{ggml_type}>")
    driver.launch(fn, (blocks,), (32 * warps,), (seg, xa.ptr, n, cols, 0, 0), _GEMV_ARG_TYPES, stream, pdl=True)
    reduce = runtime.kernel(SOURCE, "skinny_reduce")
    for out, part, bias, rows, s in reduced:
        args = (out.ptr, part.ptr, bias.ptr if bias is not None else 0, n, rows, s)
        driver.launch(reduce, (-(-n * rows // _THREADS),), (_THREADS,), args, _REDUCE_ARG_TYPES, stream, pdl=True)
    workspace.offset = mark


def gemv_glu_fits(gate: QuantWeight, up: QuantWeight, n: int) -> bool:
    """Whether skinny_gemv_glu takes gate and up at n tokens: one type, shape and layout, rows a multiple of 4, and
    both matrices' warps of a block (every split of its row tiles) within the kernel's."""
    if gate.ggml_type not in TYPES or not 0 < n <= GEMV_MAX_TOKENS or gate.rows % 4 or gate.cols % SUPERBLOCK[
            gate.ggml_type]:  # fmt: skip
        return False
    if (up.ggml_type, up.rows, up.data.shape, up.tiled) != (gate.ggml_type, gate.rows, gate.data.shape, gate.tiled):
        return False
    s = splits(gate.ggml_type, gate.rows, gate.cols, _sms())
    _, per_block, splits_per_block = gemv_blocks(gate.ggml_type, gate.rows, s)
    return splits_per_block == s and 2 * per_block * s <= _GEMV_MAX_WARPS[gate.ggml_type]


def skinny_gemv_glu(out: DeviceTensor, gate: QuantWeight, up: QuantWeight, xa: DeviceTensor, down_xa: DeviceTensor,
                    down_type: int, stream: driver.Stream) -> None:  # fmt: skip
    """out [n, rows] = silu(x gate^T) * (x up^T), with gate's and up's rows bitwise skinny_gemv's (and so
    skinny_gemm's) and SwiGLU as elementwise.swiglu computes it, in one launch (gemv_glu_fits); down_xa receives out
    as convert writes it for down_type (skinny_gemm.activation_shape(n, rows))."""
    n, rows, cols = out.shape[0], gate.rows, gate.cols
    if not gemv_glu_fits(gate, up, n):
        raise ValueError(f"skinny_gemv_glu: no fused launch for type {gate.ggml_type} [{rows}, {cols}] at {n} tokens")
    _check(out, gate, xa, None)
    if down_type not in TYPES or rows % SUPERBLOCK[down_type] or down_xa.dtype != np.uint32 or (
            down_xa.shape != activation_shape(n, rows)):  # fmt: skip
        raise ValueError(f"skinny_gemv_glu: down's input {down_xa.shape} is no layout of type {down_type} for "
                         f"{out.shape}")  # fmt: skip
    s = splits(gate.ggml_type, rows, cols, _sms())
    blocks, per_block, _ = gemv_blocks(gate.ggml_type, rows, s)
    seg = GemvSegments()
    for i, w in enumerate((gate, up)):
        seg.weight[i], seg.out[i], seg.rows[i], seg.row_bytes[i] = w.data.ptr, out.ptr, rows, w.data.shape[1]
        seg.splits[i], seg.tiles_per_block[i], seg.splits_per_block[i] = s, per_block, s
        seg.tiled[i], seg.blocks[i] = int(w.tiled), blocks
    fn = runtime.kernel(SOURCE, f"skinny_gemv<{gate.ggml_type}, true>")
    args = (seg, xa.ptr, n, cols, down_xa.ptr, down_type)
    driver.launch(fn, (blocks,), (64 * per_block * s,), args, _GEMV_ARG_TYPES, stream, pdl=True)


def _check(out: DeviceTensor, weight: QuantWeight, xa: DeviceTensor, bias: DeviceTensor | None) -> None:
    n, rows, cols = out.shape[0], weight.rows, weight.cols
    if not supports(weight, n):
        raise ValueError(f"skinny_gemm: no kernel for type {weight.ggml_type} with {cols} columns at {n} tokens")
    problem = weight.layout_error(TYPES, tiled_ok=True)
    if problem:
        raise ValueError(f"skinny_gemm: {problem}")
    if out.shape != (n, rows) or out.dtype != np.float32:
        raise ValueError(f"skinny_gemm: out must be float32 [{n}, {rows}]; got {out.shape} {out.dtype}")
    if xa.shape != activation_shape(n, cols) or xa.dtype != np.uint32:
        raise ValueError(f"skinny_gemm: x must be {activation_shape(n, cols)} uint32 from convert; got {xa.shape}")
    if bias is not None and (bias.shape != (rows,) or bias.dtype != np.float32):
        raise ValueError(f"skinny_gemm: bias must be float32 [{rows}]; got {bias.shape} {bias.dtype}")
