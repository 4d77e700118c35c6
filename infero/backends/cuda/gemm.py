"""Tensor-core GEMM for prefill and large batches: out[n, rows] = x[n, cols] @ W.T (+ bias), W in its GGUF encoding.

Two launches: x (float32) is rounded to fp16 once into workspace scratch, then `gemm<type, BM, BN>` multiplies it
by the weight, dequantizing GGUF blocks to fp16 tiles in shared memory (kernels/gemm.cu says how). The block tile
(BM weight rows x BN tokens) is picked by shape and changes only speed: every tile accumulates each output element
in the same order, so results do not depend on the batch.
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np

from infero.backends.cuda import driver, runtime
from infero.backends.cuda.tensor import DeviceTensor, QuantWeight, Workspace
from infero.checkpoint.tensor_types import BLOCK_LAYOUTS, SUPPORTED_TYPES, GGMLType

SOURCE = "gemm.cu"
SLICE = 64  # k per main-loop step (BK in gemm.cu)
TILES = ((16, 64), (32, 64), (128, 128), (128, 256))  # (weight rows, tokens) per block, smallest first
TYPES = tuple(sorted(int(t) for t in SUPPORTED_TYPES))

runtime.declare(SOURCE, ["gemm_x_to_f16"])
for _t in TYPES:
    runtime.declare(SOURCE, [f"gemm<{_t}, {bm}, {bn}>" for bm, bn in TILES], needs=(runtime.weight_type(_t),))

_CONVERT_THREADS = 256
_P, _I = ctypes.c_void_p, ctypes.c_int
_GEMM_ARG_TYPES = (_P, _P, _P, _P, _I, _I, _I, _I, _I, _I)
_CONVERT_ARG_TYPES = (_P, _P, _I, _I, _I)
_functions: dict[tuple[int, int, int], tuple[object | None, int]] = {}
runtime.on_reload(_functions.clear)
_num_sms: list[int] = []
_shared_limit: list[int] = []


def threads(tile: tuple[int, int]) -> int:
    """Threads per block, mirroring Tile<BM, BN> in gemm.cu: 2 x BN/32 warps of 64 x 32, or 4 warps of 32 x BN/4."""
    bm, bn = tile
    return 32 * (2 * bn // 32 if bm >= 64 else 4)


def shared_bytes(ggml_type: int, tile: tuple[int, int]) -> int:
    """Dynamic shared memory of gemm<ggml_type, BM, BN>, mirroring shared_bytes<T, BM, BN>() in gemm.cu."""
    bm, bn = tile
    layout = BLOCK_LAYOUTS[GGMLType(ggml_type)]
    k_stage = max(layout.elements, SLICE)
    stage_bytes = k_stage // layout.elements * layout.bytes
    chunk = 8 if ggml_type == GGMLType.Q6_K else 16
    chunks = (stage_bytes + 2 * chunk - 2) // chunk
    stride = -(-chunks * chunk // 16) * 16
    return stages(tile) * (bm * stride + bn * (SLICE + 8) * 2) + 2 * bm * (SLICE + 8) * 2


def stages(tile: tuple[int, int]) -> int:
    """Buffers of gemm.cu's activation and raw-weight rings (stages<BM>() there)."""
    return 2 if tile[0] >= 64 else 4


def _max_shared() -> int:
    if not _shared_limit:
        _shared_limit.append(runtime.context().info.max_shared_per_block_optin)
    return _shared_limit[0]


def _gemm_function(ggml_type: int, tile: tuple[int, int]) -> tuple[object | None, int]:
    """(CUfunction, shared bytes), the function None where the tile does not fit this GPU's shared memory."""
    entry = _functions.get((ggml_type, *tile))
    if entry is None:
        smem = shared_bytes(ggml_type, tile)
        fn = None
        if smem <= _max_shared():
            fn = runtime.kernel(SOURCE, f"gemm<{ggml_type}, {tile[0]}, {tile[1]}>")
            driver.set_max_dynamic_shared(fn, smem)
        entry = _functions[(ggml_type, *tile)] = (fn, smem)
    return entry


# Per tile, measured on the H200 (Q4_K, Q6_K, Q8_0; k = 4096): (us for one block alone on an SM, us per further
# block per SM once the grid fills them). Time ~ max(alone, ceil(blocks / SMs) * further); k scales both alike.
# The two small tiles (4 stages) from scripts/bench_gemm.py at n = 8..32 on llama-3.1-8b's shapes; the large
# ones from the first sweep (a 128 x 64 tile never beat them by more than a few percent).
_TILE_COST = {(16, 64): (28, 14), (32, 64): (50, 27.5), (128, 128): (120, 87), (128, 256): (155, 147)}


@functools.lru_cache(maxsize=4096)
def choose_tile(n: int, rows: int) -> tuple[int, int]:
    """The block tile for an [n, rows] output; every tile gives the same bits, only the time differs.

    Small batches want the 16- and 32-row tiles (more blocks, each short: a block's slices are a latency
    chain); full grids want the 256-token tile (it dequantizes each weight once per 256 tokens and reuses each
    activation tile for 128 rows).
    """
    if not _num_sms:
        _num_sms.append(runtime.context().info.num_sms)

    def cost(tile):
        alone, further = _TILE_COST[tile]
        blocks = -(-rows // tile[0]) * -(-n // tile[1])
        return max(alone, -(-blocks // _num_sms[0]) * further)

    return min(TILES, key=cost)


def gemm(
    out: DeviceTensor,
    weight: QuantWeight,
    x: DeviceTensor,
    bias: DeviceTensor | None,
    stream: driver.Stream,
    workspace: Workspace,
    tile: tuple[int, int] | None = None,
) -> None:
    """out[n, rows] (float32) = x[n, cols] (float32) @ weight.T + bias; `tile` forces a block tile (tests)."""
    n, rows, cols = x.shape[0], weight.rows, weight.cols
    _check(out, weight, x, bias)
    if n == 0:
        return
    chosen = tile or choose_tile(n, rows)
    fn, smem = _gemm_function(weight.ggml_type, chosen)
    if fn is None and tile is None:  # a GPU with less shared memory than the H200: the largest tile that fits
        fitting = [t for t in TILES if t[1] <= chosen[1] and shared_bytes(weight.ggml_type, t) <= _max_shared()]
        if fitting:
            chosen = fitting[-1]
            fn, smem = _gemm_function(weight.ggml_type, chosen)
    if fn is None:
        raise RuntimeError(f"gemm: {GGMLType(weight.ggml_type).name} with {chosen} tiles needs {smem:,} bytes of "
                           f"shared memory per block; this GPU allows {_max_shared():,}")  # fmt: skip
    convert = runtime.kernel(SOURCE, "gemm_x_to_f16")
    kp = -(-cols // SLICE) * SLICE
    # The fp16 copy of x is scratch: its workspace space is handed back after the launches (kernels on the
    # stream run in order, so the next user of those bytes runs after the GEMM has read them).
    mark = workspace.offset
    xh = workspace.empty((n, kp), np.float16)
    groups = n * kp // 8
    driver.launch(convert, (-(-groups // _CONVERT_THREADS),), (_CONVERT_THREADS,), (xh.ptr, x.ptr, n, cols, kp),
                  _CONVERT_ARG_TYPES, stream, pdl=True)  # fmt: skip
    row_bytes = weight.data.shape[1]
    args = (out.ptr, weight.data.ptr, xh.ptr, bias.ptr if bias is not None else 0, n, rows, cols, kp, row_bytes,
            int(weight.tiled))  # fmt: skip
    grid = (-(-rows // chosen[0]) * -(-n // chosen[1]),)
    driver.launch(fn, grid, (threads(chosen),), args, _GEMM_ARG_TYPES, stream, shared=smem, pdl=True)
    workspace.offset = mark


def _check(out: DeviceTensor, weight: QuantWeight, x: DeviceTensor, bias: DeviceTensor | None) -> None:
    n, rows, cols = x.shape[0], weight.rows, weight.cols
    if weight.ggml_type not in TYPES:
        raise ValueError(f"gemm: no kernel for GGML type {weight.ggml_type}")
    layout = BLOCK_LAYOUTS[weight.ggml_type]  # keyed by GGMLType, an IntEnum: the int finds it (no enum call a launch)
    if cols % layout.elements or cols % 8:
        raise ValueError(f"gemm: {cols} columns is not a multiple of {max(layout.elements, 8)}")
    if problem := weight.layout_error(TYPES, tiled_ok=True):
        raise ValueError(f"gemm: {problem}")
    if x.shape != (n, cols) or x.dtype != np.float32 or x.ptr % 16:
        raise ValueError(f"gemm: x must be float32 [{n}, {cols}], 16-byte aligned; got {x.shape} {x.dtype}")
    if out.shape != (n, rows) or out.dtype != np.float32:
        raise ValueError(f"gemm: out must be float32 [{n}, {rows}]; got {out.shape} {out.dtype}")
    if bias is not None and (bias.shape != (rows,) or bias.dtype != np.float32):
        raise ValueError(f"gemm: bias must be float32 [{rows}]; got {bias.shape} {bias.dtype}")
