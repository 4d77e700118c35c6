"""The int8 tensor-core linear layer for steps of more than the mat-vec's tokens (Q4_K-Q6_K, Q8_0, Q4_0-Q5_1, IQ4):
out[n, rows] = x @ W.T (+ bias), x in the mat-vec's activation format (matvec.quantize, or a fused writer; a
deferred norm's too). Every row is bitwise what matvec_q gives the token alone (kernels/linear_mma.cu says how):
a prefill chunk, a batched decode step and a mixed step give a request the same bits.
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np

from infero.backends.cuda import driver, matvec, runtime
from infero.backends.cuda.tensor import DeviceTensor, QuantWeight, Workspace
from infero.checkpoint.tensor_types import GGMLType

SOURCE = "linear_mma.cu"
_NAMES = ("Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "IQ4_XS")
TYPES = tuple(int(GGMLType[name]) for name in _NAMES)
STAGE_COLS = 256  # columns a stage: the kernel's KU units of 32
# Types whose rows may end inside a stage (linear_mma.cu's lm::PARTIAL): columns a multiple of 32, not 256.
PARTIAL_TYPES = (int(GGMLType.Q8_0),)
# The kernel's block tiles (WR, WT): 16 WR rows x 32 WT tokens, in 16 warps of 16 rows x 16 tokens.
NARROW, WIDE = (8, 1), (4, 2)
THREADS = 512
_STATIC_SHARED = 4 * 64  # the kernel's static shared memory (a float a token of a block)
MAX_SPLITS = 16
# mma_units.cuh's Policy<T>::PIECES: 16-byte pieces a (stage, row)
_PIECES = {12: 9, 13: 11, 14: 14, 8: 17, 2: 9, 3: 10, 6: 11, 7: 12, 20: 9, 23: 9}
_PREP = (12, 13)  # Policy<T>::PREP: {A, B} staged per (row, unit)

runtime.declare(SOURCE, ["linear_mma_finish"])
for _t in TYPES:
    runtime.declare(SOURCE, [f"linear_mma<{_t}, {wr}, {wt}>" for wr, wt in (NARROW, WIDE)],
                    needs=(runtime.weight_type(_t),))  # fmt: skip

_P, _I, _L, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong, ctypes.c_float
_ARGS = (_P, _P, _P, _P, _P, _P, _P, _F, _P, _I, _I, _I, _L, _I, _I, _I)
_FINISH_ARGS = (_P, _P, _P, _P, _F, _P, _I, _I, _I, _I)
_shared_allowed: dict[object, int] = {}
runtime.on_reload(_shared_allowed.clear)
_num_sms: list[int] = []


def supports(weight: QuantWeight, n: int) -> bool:
    unit_cols = 32 if weight.ggml_type in PARTIAL_TYPES else STAGE_COLS
    if not (weight.ggml_type in TYPES and n > 0 and weight.cols % unit_cols == 0):
        return False
    return buffers(weight.ggml_type, n, runtime.context().info.max_shared_per_block_optin) > 0


def grid_of(n: int) -> tuple[int, int]:
    """The block tile (WR, WT) for n tokens: 32 tokens to 32, 64 above."""
    return NARROW if n <= 32 else WIDE


def buffer_bytes(ggml_type: int, n: int) -> int:
    """Shared memory of one stage buffer: activations and scales (640 bytes a token), weight pieces and, for Q4_K /
    Q5_K, each (row, unit)'s {A, B} (8 bytes) and three more copies of each row's 16-byte header."""
    wr, wt = grid_of(n)
    rows = 16 * wr
    return 640 * 32 * wt + 16 * _PIECES[ggml_type] * rows + (112 * rows if ggml_type in _PREP else 0)


def buffers(ggml_type: int, n: int, shared_optin: int) -> int:
    """Stage buffers a launch takes within a block's shared memory limit: 3 (two stages in flight), else 2, else 0
    (the device cannot run it)."""
    fits = [b for b in (3, 2) if b * buffer_bytes(ggml_type, n) + _STATIC_SHARED <= shared_optin]
    return fits[0] if fits else 0


@functools.lru_cache(maxsize=1024)
def splits(rows: int, cols: int, n: int, num_sms: int) -> int:
    """Contiguous stage ranges per (row tile, token tile), only where the tiles leave SMs idle (a block an SM; a
    split's partial sums cost workspace and a round trip): the fewest stages per block in the fewest waves of at
    most two, each split costing half a stage."""
    wr, wt = grid_of(n)
    blocks = -(-rows // (16 * wr)) * -(-n // (32 * wt))
    stages = -(-cols // STAGE_COLS)

    def cost(s: int) -> float:
        return -(-blocks * s // num_sms) * -(-stages // s) + 0.5 * (s - 1)

    if blocks >= num_sms:
        return 1
    return min(range(1, min(MAX_SPLITS, stages, 2 * num_sms // blocks) + 1), key=cost)


def scratch_bytes(rows: int, cols: int, n: int, num_sms: int) -> int:
    """Workspace bytes a launch borrows (and hands back): the splits' int64 sums and float probes, where it splits."""
    s = splits(rows, cols, n, num_sms)
    return s * n * rows * 12 if s > 1 else 0


def _sms() -> int:
    if not _num_sms:
        _num_sms.append(runtime.context().info.num_sms)
    return _num_sms[0]


def _function(ggml_type: int, n: int, shared: int):
    wr, wt = grid_of(n)
    fn = runtime.kernel(SOURCE, f"linear_mma<{ggml_type}, {wr}, {wt}>")
    if shared > _shared_allowed.get(fn, 48 << 10):
        driver.set_max_dynamic_shared(fn, shared)
        _shared_allowed[fn] = shared
    return fn


def linear_mma(out: DeviceTensor, weight: QuantWeight, quantized, bias: DeviceTensor | None, stream: driver.Stream,
               workspace: Workspace) -> None:  # fmt: skip
    """out[n, rows] (float32) = x @ weight.T + bias, x as `quantized`: (xq, xs) of matvec.activation_shapes(n, cols)
    or a matvec.Activation (a deferred norm's)."""
    n, rows, cols = out.shape[0], weight.rows, weight.cols
    xq, xs = quantized[0], quantized[1]
    _check(out, weight, xq, xs, bias)
    deferred = len(quantized) > 2 and quantized[2] is not None
    norm_ptr, eps = (quantized[2].ptr, float(quantized[3])) if deferred else (0, 0.0)
    wr, wt = grid_of(n)
    s = splits(rows, cols, n, _sms())
    grid = (-(-rows // (16 * wr)), -(-n // (32 * wt)), s)
    bias_ptr = bias.ptr if bias is not None else 0
    mark = workspace.offset  # the splits' sums are scratch, handed back after the launches (stream order)
    part_v = workspace.empty((s, n, rows), np.int64) if s > 1 else None
    part_p = workspace.empty((s, n, rows), np.float32) if s > 1 else None
    bufs = buffers(weight.ggml_type, n, runtime.context().info.max_shared_per_block_optin)
    shared = bufs * buffer_bytes(weight.ggml_type, n)
    args = (out.ptr, part_v.ptr if s > 1 else 0, part_p.ptr if s > 1 else 0, weight.data.ptr, xq.ptr, xs.ptr,
            norm_ptr, eps, bias_ptr, n, rows, cols, weight.data.shape[1], int(weight.tiled), s, bufs)  # fmt: skip
    driver.launch(_function(weight.ggml_type, n, shared), grid, (THREADS,), args, _ARGS, stream, shared=shared,
                  pdl=True)  # fmt: skip
    if s > 1:
        finish = runtime.kernel(SOURCE, "linear_mma_finish")
        driver.launch(finish, (-(-rows // THREADS), n), (THREADS,),
                      (out.ptr, part_v.ptr, part_p.ptr, norm_ptr, eps, bias_ptr, n, rows, cols, s), _FINISH_ARGS,
                      stream, pdl=True)  # fmt: skip
    workspace.offset = mark


def _check(out: DeviceTensor, weight: QuantWeight, xq: DeviceTensor, xs: DeviceTensor,
           bias: DeviceTensor | None) -> None:  # fmt: skip
    n, rows, cols = out.shape[0], weight.rows, weight.cols
    problem = weight.layout_error(TYPES, tiled_ok=True)
    if problem:
        raise ValueError(f"linear_mma: {problem}")
    if not supports(weight, n):
        raise ValueError(f"linear_mma: no kernel for type {weight.ggml_type} with {cols} columns at {n} tokens "
                         f"(types {TYPES}, columns a multiple of {STAGE_COLS} or for {PARTIAL_TYPES} of 32, shared "
                         f"memory for two stage buffers)")  # fmt: skip
    if n > 65535 * 32 * grid_of(n)[1]:
        raise ValueError(f"linear_mma: {n} tokens exceed the launch's grid")
    if out.shape != (n, rows) or out.dtype != np.float32:
        raise ValueError(f"linear_mma: out must be float32 [{n}, {rows}]; got {out.shape} {out.dtype}")
    if (xq.shape, xs.shape) != matvec.activation_shapes(n, cols) or xq.dtype != np.int8:
        raise ValueError(f"linear_mma: the activation must be matvec.activation_shapes({n}, {cols}) from "
                         f"matvec.quantize; got {xq.shape} {xq.dtype} / {xs.shape}")  # fmt: skip
    if bias is not None and (bias.shape != (rows,) or bias.dtype != np.float32):
        raise ValueError(f"linear_mma: bias must be float32 [{rows}]; got {bias.shape} {bias.dtype}")
