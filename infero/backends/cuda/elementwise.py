"""Launchers for kernels/elementwise.cu: add + RMSNorm, RMSNorm, fused rotary + KV-cache write (alone or after the
per-head q/k RMSNorm), SwiGLU, row gather.

Each launcher checks shapes and dtypes, allocates nothing and launches one kernel on `stream`. The kernel variant
is chosen from the row length alone (never from the number of rows), so results are batch invariant.
"""

from __future__ import annotations

import ctypes

import numpy as np

from infero.backends.cuda import driver, matvec, runtime, skinny_gemm
from infero.backends.cuda.tensor import DeviceTensor, Strided

SOURCE = "elementwise.cu"
NORM_VPT = (1, 2, 4, 8, 16)  # float4 per thread, row per block of 256: dim <= 1024 * VPT
ROW_VPT = (1, 2, 4)  # float4 per lane, row per warp: dim <= 128 * VPT
MAX_ROW_PER_WARP_DIM = 128 * ROW_VPT[-1]
_WORDS = {16: "uint4", 4: "unsigned int", 1: "unsigned char"}


def _b(flag: bool) -> str:
    return "true" if flag else "false"


runtime.declare(
    SOURCE,
    [f"add_rms_norm<{v}, {_b(add)}, {_b(quant)}>" for v in NORM_VPT for add in (False, True) for quant in (False, True)]
    + [f"add_rms_norm<{v}, {_b(add)}, true, true>" for v in NORM_VPT for add in (False, True)]
    + [f"rms_norm_rows<{v}>" for v in ROW_VPT]
    + ["rotary_store_kv<false>", "rotary_store_kv<true>", "swiglu<false, false>", "swiglu<true, false>"]
    + [f"qk_norm_rotary_store_kv<{v}, {_b(neox)}>" for v in ROW_VPT for neox in (False, True)]
    + ["swiglu<true, true>"]
    + [f"gather_rows<{w}>" for w in _WORDS.values()],
)

_P, _I, _L, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong, ctypes.c_float
_functions: dict[str, object] = {}
runtime.on_reload(_functions.clear)


def _kernel(expression: str):
    fn = _functions.get(expression)
    if fn is None:
        fn = _functions[expression] = runtime.kernel(SOURCE, expression)
    return fn


def _require(cond: bool, message) -> None:
    """Raise ValueError(message()) unless cond; the message is only formatted on failure (launchers run per step)."""
    if not cond:
        raise ValueError(message())


def _f32(name: str, t: DeviceTensor) -> None:
    _require(t.dtype == np.float32, lambda: f"{name} must be float32, got {t.dtype}")


def _norm_vpt(dim: int) -> int:
    _require(dim % 4 == 0, lambda: f"RMSNorm needs a row length divisible by 4, got {dim}")
    for v in NORM_VPT:
        if dim <= 1024 * v:
            return v
    raise ValueError(f"RMSNorm rows longer than {1024 * NORM_VPT[-1]} are not compiled (got {dim})")


def add_rms_norm(
    out: DeviceTensor,
    residual: DeviceTensor,
    x: DeviceTensor | None,
    weight: DeviceTensor,
    eps: float,
    stream: driver.Stream,
    quantized=None,
    skinny: tuple[DeviceTensor, int] | None = None,
) -> None:
    """residual += x (in place; x None: residual unchanged), then out = residual / rms(residual) * weight.
    quantized: (xq int8, xs int32) of matvec.activation_shapes(rows, dim) to receive out in the mat-vec's activation
    format as well (kernels/act_quant.cuh; dim % 32 == 0); a matvec.Activation with norm_ss receives the deferred
    form instead (residual * weight, each 32-element group's sum of squares of the residual in norm_ss: what
    matvec.matvec_norm writes, its readers applying 1 / rms). skinny: (xa, weight type) to receive out as
    skinny_gemm.convert writes it for that type (xa uint32 of skinny_gemm.activation_shape(rows, dim)), the same
    bits, the padding tokens' slots untouched."""
    dim = residual.shape[-1]
    rows = residual.numel // dim if dim else 0
    for name, t in (("out", out), ("residual", residual), ("weight", weight)) + ((("x", x),) if x is not None else ()):
        _f32(name, t)
    _require(out.shape == residual.shape, lambda: f"out {out.shape} must have the shape of residual {residual.shape}")
    _require(x is None or x.shape == residual.shape, lambda: f"x {x and x.shape} must have the shape of residual")
    _require(weight.numel == dim, lambda: f"weight has {weight.numel} elements, rows have {dim}")
    if rows == 0:
        return
    add = x is not None
    norm_ss = getattr(quantized, "norm_ss", None)
    if quantized is not None:
        matvec.check_activation(quantized, rows, dim)
    xq, xs = (quantized[0].ptr, quantized[1].ptr) if quantized is not None else (0, 0)
    defer = ", true" if norm_ss is not None else ""
    xa, xa_type, xa_tiles = 0, 0, 0
    if skinny is not None:
        layout, xa_type = skinny
        fits = xa_type in skinny_gemm.TYPES and dim % skinny_gemm.SUPERBLOCK.get(xa_type, 1) == 0
        fits = fits and rows <= skinny_gemm.MAX_TOKENS
        _require(fits and layout.dtype == np.uint32 and layout.shape == skinny_gemm.activation_shape(rows, dim),
                 lambda: f"skinny: no layout of type {xa_type} for {rows} rows of {dim} in {layout.shape}")  # fmt: skip
        xa, xa_tiles = layout.ptr, skinny_gemm.tiles(rows)
    fn = _kernel(f"add_rms_norm<{_norm_vpt(dim)}, {_b(add)}, {_b(quantized is not None)}{defer}>")
    args = (out.ptr, residual.ptr, x.ptr if add else 0, weight.ptr, dim, eps, xq, xs, rows,
            norm_ss.ptr if norm_ss is not None else 0, xa, xa_type, xa_tiles)  # fmt: skip
    driver.launch(fn, (rows,), (256,), args, _NORM_ARGS, stream, pdl=True)


_NORM_ARGS = (_P, _P, _P, _P, _I, _F, _P, _P, _I, _P, _P, _I, _I)


def rms_norm(out: DeviceTensor, x: DeviceTensor, weight: DeviceTensor, eps: float, stream: driver.Stream) -> None:
    """out = x / rms(x) * weight over the last dim, for any leading shape (per head: x [n, heads, head_dim])."""
    dim = x.shape[-1]
    rows = x.numel // dim if dim else 0
    for name, t in (("out", out), ("x", x), ("weight", weight)):
        _f32(name, t)
    _require(out.shape == x.shape, lambda: f"out {out.shape} must have the shape of x {x.shape}")
    _require(weight.numel == dim, lambda: f"weight has {weight.numel} elements, rows have {dim}")
    if rows == 0:
        return
    _require(dim % 4 == 0, lambda: f"RMSNorm needs a row length divisible by 4, got {dim}")
    if dim <= MAX_ROW_PER_WARP_DIM:
        vpt = next(v for v in ROW_VPT if dim <= 128 * v)
        args = (out.ptr, x.ptr, weight.ptr, rows, dim, eps)
        driver.launch(
            _kernel(f"rms_norm_rows<{vpt}>"), (-(-rows // 8),), (256,), args, (_P, _P, _P, _I, _I, _F), stream, pdl=True
        )
    else:
        # The row-per-block kernel without the add only reads its `residual` argument.
        fn = _kernel(f"add_rms_norm<{_norm_vpt(dim)}, false, false>")
        args = (out.ptr, x.ptr, 0, weight.ptr, dim, eps, 0, 0, rows, 0, 0, 0, 0)
        driver.launch(fn, (rows,), (256,), args, _NORM_ARGS, stream, pdl=True)


def rotary_store_kv(q: DeviceTensor, k: DeviceTensor, v: DeviceTensor, positions: DeviceTensor,
                    inv_freq: DeviceTensor, mscale: float, pairing: str, rope_dim: int, k_cache: DeviceTensor,
                    v_cache: DeviceTensor, slot_mapping: DeviceTensor, stream: driver.Stream) -> None:  # fmt: skip
    """Rotate q [n, heads, head_dim] and k [n, kv_heads, head_dim] in place by position (fp32 angles), and
    write k and v as fp16 into their cache slots (negative slots are skipped)."""
    _check_rotary(q, k, v, positions, inv_freq, pairing, rope_dim, k_cache, v_cache, slot_mapping)
    n, heads, head_dim = q.shape
    if n == 0:
        return
    fn = _kernel(f"rotary_store_kv<{'true' if pairing == 'neox' else 'false'}>")
    args = (q.ptr, k.ptr, v.ptr, positions.ptr, inv_freq.ptr, mscale, rope_dim // 2, heads, k.shape[1], head_dim,
            k_cache.ptr, v_cache.ptr, slot_mapping.ptr)  # fmt: skip
    types = (_P, _P, _P, _P, _P, _F, _I, _I, _I, _I, _P, _P, _P)
    driver.launch(fn, (n,), (256,), args, types, stream, pdl=True)


def qk_norm_rotary_store_kv(q: DeviceTensor, k: DeviceTensor, v: DeviceTensor, q_norm: DeviceTensor,
                            k_norm: DeviceTensor, eps: float, positions: DeviceTensor, inv_freq: DeviceTensor,
                            mscale: float, pairing: str, rope_dim: int, k_cache: DeviceTensor, v_cache: DeviceTensor,
                            slot_mapping: DeviceTensor, stream: driver.Stream,
                            q_in: Strided | None = None) -> None:  # fmt: skip
    """rms_norm of each q head (weight q_norm) and k head (k_norm), then rotary_store_kv, in one launch: bitwise
    the three launches. q is written in place, or from q_in: the heads of q's shape read as columns of wider rows
    (Qwen3.5's [q | gate] heads: columns(q_gate, 0, head_dim)); k keeps its input values (its normed, rotated
    values go only to the cache)."""
    _check_rotary(q, k, v, positions, inv_freq, pairing, rope_dim, k_cache, v_cache, slot_mapping)
    n, heads, head_dim = q.shape
    limit = MAX_ROW_PER_WARP_DIM
    _require(head_dim % 4 == 0 and head_dim <= limit,
             lambda: f"the q/k norm needs head_dim divisible by 4 and <= {limit}, got {head_dim}")  # fmt: skip
    if q_in is None:
        q_in = Strided(q, 0, n * heads, head_dim, head_dim)
    _require(q_in.dtype == np.float32 and q_in.rows == n * heads and q_in.cols == head_dim and q_in.stride % 4 == 0,
             lambda: f"q_in must be {n * heads} float32 heads of {head_dim} a multiple of 4 floats apart, got "
                     f"{q_in.rows} of {q_in.cols} ({q_in.stride} apart)")  # fmt: skip
    for name, w in (("q_norm", q_norm), ("k_norm", k_norm)):
        _f32(name, w)
        if w.numel != head_dim:
            raise ValueError(f"{name} has {w.numel} elements, heads have {head_dim}")
    _require(all(t.ptr % 16 == 0 for t in (q, q_in, k, q_norm, k_norm)),
             lambda: "q, q_in, k, q_norm and k_norm must be 16-byte aligned (rows are read as float4)")  # fmt: skip
    if n == 0:
        return
    vpt = next(v for v in ROW_VPT if head_dim <= 128 * v)  # rms_norm's row-per-warp choice: the same sum order
    fn = _kernel(f"qk_norm_rotary_store_kv<{vpt}, {_b(pairing == 'neox')}>")
    kv_heads = k.shape[1]
    args = (q.ptr, q_in.ptr, q_in.stride, k.ptr, v.ptr, q_norm.ptr, k_norm.ptr, eps, positions.ptr, inv_freq.ptr,
            mscale, rope_dim // 2, heads, kv_heads, head_dim, k_cache.ptr, v_cache.ptr, slot_mapping.ptr)  # fmt: skip
    types = (_P, _P, _I, _P, _P, _P, _P, _F, _P, _P, _F, _I, _I, _I, _I, _P, _P, _P)
    driver.launch(fn, (n, -(-(heads + kv_heads) // 8)), (256,), args, types, stream, pdl=True)


def _check_rotary(q, k, v, positions, inv_freq, pairing, rope_dim, k_cache, v_cache, slot_mapping) -> None:
    """The shapes and dtypes rotary_store_kv's kernels take (q [n, heads, head_dim], k and v [n, kv_heads,
    head_dim], the fp16 caches of kv_heads x head_dim slots)."""
    _require(
        len(q.shape) == 3 and len(k.shape) == 3, lambda: f"q {q.shape} and k {k.shape} must be [n, heads, head_dim]"
    )
    n, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    for name, t in (("q", q), ("k", k), ("v", v), ("inv_freq", inv_freq)):
        _f32(name, t)
    _require(k.shape == (n, kv_heads, head_dim) and v.shape == k.shape,
             lambda: f"k {k.shape} and v {v.shape} must be [{n}, kv_heads, {head_dim}]")  # fmt: skip
    _require(pairing in ("interleaved", "neox"), lambda: f"pairing must be 'interleaved' or 'neox', got {pairing!r}")
    _require(head_dim % 2 == 0 and head_dim <= 512, lambda: f"head_dim must be even and <= 512, got {head_dim}")
    _require(
        rope_dim % 2 == 0 and 0 <= rope_dim <= head_dim, lambda: f"rope_dim {rope_dim} must be even, <= {head_dim}"
    )
    _require(
        inv_freq.numel == rope_dim // 2, lambda: f"inv_freq has {inv_freq.numel} entries, rope_dim/2 is {rope_dim // 2}"
    )
    _require(positions.dtype == np.int32 and positions.numel == n, lambda: f"positions must be int32 [{n}]")
    _require(slot_mapping.dtype == np.int64 and slot_mapping.numel == n, lambda: f"slot_mapping must be int64 [{n}]")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not (cache.dtype == np.float16 and len(cache.shape) == 4 and cache.shape[2:] == (kv_heads, head_dim)):
            raise ValueError(f"{name} must be fp16 [blocks, block_size, {kv_heads}, {head_dim}], got {cache.dtype} "
                             f"{cache.shape}")  # fmt: skip


def swiglu(out: DeviceTensor, gate: DeviceTensor, up: DeviceTensor, stream: driver.Stream,
           quantized: tuple[DeviceTensor, DeviceTensor] | None = None) -> None:  # fmt: skip
    """out = silu(gate) * up, elementwise (out may be gate or up). quantized: as for add_rms_norm (rows are
    gate's last dim; needs 16-byte aligned float4 access)."""
    for name, t in (("out", out), ("gate", gate), ("up", up)):
        _f32(name, t)
    _require(
        gate.shape == up.shape == out.shape, lambda: f"gate {gate.shape}, up {up.shape}, out {out.shape} must match"
    )
    n = gate.numel
    if n == 0:
        return
    vec = n % 4 == 0 and all(t.ptr % 16 == 0 for t in (out, gate, up))
    cols = gate.shape[-1]
    xq = xs = 0
    if quantized is not None:
        _require(vec, lambda: "quantized SwiGLU output needs 16-byte aligned tensors")
        matvec.check_activation(quantized, n // cols, cols)
        xq, xs = quantized[0].ptr, quantized[1].ptr
    items = n // 4 if vec else n
    fn = _kernel(f"swiglu<{_b(vec)}, {_b(quantized is not None)}>")
    args = (out.ptr, gate.ptr, up.ptr, n, xq, xs, cols)
    driver.launch(fn, (-(-items // 256),), (256,), args, (_P, _P, _P, _L, _P, _P, _I), stream, pdl=True)


def gather_rows(out: DeviceTensor, x: DeviceTensor, indices: DeviceTensor, stream: driver.Stream) -> None:
    """out[i] = x[indices[i]] over the first dim (indices int32, any row dtype)."""
    _require(indices.dtype == np.int32, lambda: f"indices must be int32, got {indices.dtype}")
    rows = indices.numel
    _require(out.dtype == x.dtype and out.shape == (rows,) + tuple(x.shape[1:]),
             f"out {out.dtype} {out.shape} must be {x.dtype} {(rows,) + tuple(x.shape[1:])}")  # fmt: skip
    if rows == 0 or x.numel == 0:
        return
    row_bytes = x.nbytes // x.shape[0]
    size = next(s for s in _WORDS if row_bytes % s == 0 and x.ptr % s == 0 and out.ptr % s == 0)
    words = row_bytes // size
    fn = _kernel(f"gather_rows<{_WORDS[size]}>")
    col_blocks = min(-(-words // 256), 65535)
    args = (out.ptr, x.ptr, indices.ptr, words)
    driver.launch(fn, (rows, col_blocks), (256,), args, (_P, _P, _P, _L), stream, pdl=True)
