"""Paged causal grouped-query attention over the fp16 KV cache (kernels/attention.cu).

Decode sequences (one new token) go to a split-KV kernel: all query heads of a kv group together on tensor cores,
one split of the context at a time, then a second kernel merges the splits (log-sum-exp). A sequence's splits
depend on its own context length alone (64 keys each, at most 32 splits), so its bits never depend on the batch;
how many CTAs share a sequence's splits is chosen from the batch to fill the GPU, which moves work, not results.
Prefill chunks (two or more new tokens) go to a flash-attention kernel. A mixed batch launches both; each kernel
skips the other's sequences, so a decode sequence gets the same bits in a mixed batch as in a decode batch.
Both kernels double-buffer their K/V tiles where two stages fit the GPU's shared memory, else take one (head dim
256 on GPUs that let a block opt in to less than 132 KiB: sm_86, sm_89, sm_120); the stages change when a tile
loads, never the arithmetic, so the bits do not depend on the GPU.
"""

from __future__ import annotations

import ctypes

import numpy as np

from infero.backends.cuda import driver, matvec, runtime
from infero.backends.cuda.tensor import DeviceTensor, Workspace

FILE = "attention.cu"
HEAD_DIMS = (64, 128, 256)
# Decode splits (mirrors decode_splits in the kernel): DECODE_MIN_PARTITION keys each until a sequence has
# DECODE_MAX_SPLITS, then longer ones. Never derived from the batch.
DECODE_MIN_PARTITION = 64
DECODE_MAX_SPLITS = 32
DECODE_CTAS_PER_SM = 3  # decode CTAs a launch aims for per SM (3 fit at once at head_dim 128, 4 at 64, 1 at 256)
_BLOCK_N = 64  # must match kernels/attention.cu
_ROWS_PREFILL, _ROWS_DECODE = 64, 16
# The least shared memory a block may opt in to on a GPU the kernels run on (sm_86, sm_89, sm_120: 99 KiB; sm_80
# 163 KiB, sm_90 227 KiB): a head dim whose two stages need more also gets one-stage kernels.
_LEAST_SHARED_OPTIN = 99 * 1024


def tile_shared_bytes(head_dim: int, stages: int) -> int:
    """Dynamic shared memory of the two attention kernels: K and V tiles, `stages` deep, rows padded by 8 halves."""
    return stages * 2 * _BLOCK_N * (head_dim + 8) * 2


def prefill_threads(head_dim: int) -> int:
    """attention_prefill's block: 4 warps of rows, times the warps that split O's head dim (prefill_warps_n)."""
    return 128 * (2 if head_dim > 128 else 1)


def _name(kind: str, head_dim: int, stages: int = 2) -> str:
    return f"attention_{kind}<{head_dim}>" if stages == 2 else f"attention_{kind}<{head_dim}, {stages}>"


for _hd in HEAD_DIMS:
    runtime.declare(FILE, [_name(kind, _hd) for kind in ("prefill", "decode", "merge_splits")],
                    needs=(runtime.head_dim(_hd),))  # fmt: skip
    if tile_shared_bytes(_hd, 2) > _LEAST_SHARED_OPTIN:  # its own unit: compiled in parallel with the first
        runtime.declare(FILE, [_name(kind, _hd, 1) for kind in ("prefill", "decode")], needs=(runtime.head_dim(_hd),),
                        part="one stage")  # fmt: skip

_P, _I = ctypes.c_void_p, ctypes.c_int
_ATTENTION_TYPES = (_P,) * 9 + (_I,) * 5 + (ctypes.c_float, _P, _P, _I)  # ATTENTION_PARAMS
_MERGE_TYPES = (_P,) * 5 + (_I,) * 2 + (_P, _P, _I)
_LOG2E = 1.4426950408889634
_functions: dict[tuple[str, int, int], object] = {}
runtime.on_reload(_functions.clear)
_num_sms: list[int] = []
_shared_optin: list[int] = []


def decode_grid_splits(max_context_len: int) -> int:
    """Split slots per sequence of a decode launch: the most splits any context up to max_context_len takes."""
    return max(1, min(-(-max_context_len // DECODE_MIN_PARTITION), DECODE_MAX_SPLITS))


def paged_attention(
    out: DeviceTensor,
    q: DeviceTensor,
    k_cache: DeviceTensor,
    v_cache: DeviceTensor,
    block_tables: DeviceTensor,
    context_lens: DeviceTensor,
    query_starts: DeviceTensor,
    scale: float,
    max_query_len: int,
    max_context_len: int,
    stream: driver.Stream,
    workspace: Workspace,
    num_decode_seqs: int | None = None,
    quantized: tuple[DeviceTensor, DeviceTensor] | None = None,
) -> None:
    """out[t, h] = softmax(scale * q[t, h] . K) V over each sequence's cached keys up to the token's position.

    q, out: float32 [num_tokens, num_heads, head_dim]; k_cache, v_cache: float16 [num_blocks, block_size,
    num_kv_heads, head_dim]; block_tables int32 [num_seqs, max_blocks]; context_lens int32 [num_seqs] (this
    step's tokens included, already written to the cache); query_starts int32 [num_seqs + 1].
    max_query_len, max_context_len: bounds over the batch that size the grids (CTAs past a sequence's own
    lengths exit at once). max_context_len must be >= every context length (a decode sequence past it gets
    NaN); a captured graph may pass a fixed bound: past 8,192 it no longer grows the grid.
    num_decode_seqs: how many sequences have exactly one new token, or None if unknown; 0 with
    max_query_len > 1 skips the decode launch. quantized: (xq int8, xs int32) of
    matvec.activation_shapes(num_tokens, num_heads * head_dim) to receive out in the mat-vec's activation format
    as well (kernels/act_quant.cuh), only where every token is a decode token (max_query_len 1). Borrows
    the decode splits' partials from the workspace (float32 [num_seqs, num_heads, splits, head_dim] and their (m, l)
    pairs, splits = decode_grid_splits(max_context_len)) and hands them back before returning (stream order makes
    the reuse safe); never synchronizes.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, kv_dim = k_cache.shape
    num_seqs, max_blocks = block_tables.shape
    _check(out, q, k_cache, v_cache, block_tables, context_lens, query_starts)
    if head_dim not in HEAD_DIMS or kv_dim != head_dim:
        raise ValueError(f"attention supports head_dim {HEAD_DIMS}; got q {head_dim}, cache {kv_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not group evenly over {num_kv_heads} kv heads")
    xq = xs = 0
    if quantized is not None:
        if max_query_len != 1:
            raise ValueError("attention: the quantized output is written by the decode kernels: every token must be "
                             f"a decode token (max_query_len 1), got {max_query_len}")  # fmt: skip
        matvec.check_activation(quantized, num_tokens, num_heads * head_dim)
        xq, xs = quantized[0].ptr, quantized[1].ptr
    if num_seqs == 0 or num_tokens == 0 or max_query_len < 1:
        return
    group = num_heads // num_kv_heads
    args = [out.ptr, q.ptr, k_cache.ptr, v_cache.ptr, block_tables.ptr, context_lens.ptr, query_starts.ptr, 0, 0,
            num_heads, num_kv_heads, block_size, max_blocks, 1, scale * _LOG2E, xq, xs, num_tokens]  # fmt: skip
    stages = _stages(head_dim)
    smem = tile_shared_bytes(head_dim, stages)

    if max_query_len > 1:
        grid = (-(-max_query_len * group // _ROWS_PREFILL), num_kv_heads, num_seqs)
        fn = _function("prefill", head_dim, stages)
        driver.launch(fn, grid, (prefill_threads(head_dim),), tuple(args), _ATTENTION_TYPES, stream, smem, pdl=True)
        if num_decode_seqs == 0:
            return

    max_splits = decode_grid_splits(max_context_len)
    row_tiles = -(-group // _ROWS_DECODE)
    mark = workspace.offset
    if max_splits > 1:
        part_out = workspace.empty((num_seqs, num_heads, max_splits, head_dim), np.float32)
        part_ml = workspace.empty((num_seqs, num_heads, max_splits, 2), np.float32)
        args[7], args[8] = part_out.ptr, part_ml.ptr
    args[13] = max_splits
    # CTAs per (sequence, kv head): enough to fill the GPU at small batches, one at large ones.
    ctas = -(-DECODE_CTAS_PER_SM * _sm_count() // (num_seqs * num_kv_heads * row_tiles))
    grid = (max(1, min(max_splits, ctas)), num_kv_heads, num_seqs * row_tiles)
    decode = _function("decode", head_dim, stages)
    driver.launch(decode, grid, (128,), tuple(args), _ATTENTION_TYPES, stream, smem, pdl=True, carveout=True)
    if max_splits > 1:
        merge_args = (out.ptr, part_out.ptr, part_ml.ptr, context_lens.ptr, query_starts.ptr, num_heads, max_splits,
                      xq, xs, num_tokens)  # fmt: skip
        driver.launch(_function("merge_splits", head_dim), (num_heads, num_seqs), (head_dim,), merge_args,
                      _MERGE_TYPES, stream, pdl=True)  # fmt: skip
    workspace.offset = mark  # the partials are dead once the merge (queued on this stream) has run


def _stages(head_dim: int) -> int:
    """K/V tile stages: two where they fit the GPU's shared memory, else one."""
    if not _shared_optin:
        _shared_optin.append(runtime.context().info.max_shared_per_block_optin)
    return 2 if tile_shared_bytes(head_dim, 2) <= _shared_optin[0] else 1


def _function(kind: str, head_dim: int, stages: int = 2):
    fn = _functions.get((kind, head_dim, stages))
    if fn is None:
        fn = runtime.kernel(FILE, _name(kind, head_dim, stages))
        if kind != "merge_splits":
            driver.set_max_dynamic_shared(fn, tile_shared_bytes(head_dim, stages))
        _functions[(kind, head_dim, stages)] = fn
    return fn


def _sm_count() -> int:
    if not _num_sms:
        _num_sms.append(runtime.context().info.num_sms)
    return _num_sms[0]


def _check(out, q, k_cache, v_cache, block_tables, context_lens, query_starts) -> None:
    f32, f16, i32 = np.dtype(np.float32), np.dtype(np.float16), np.dtype(np.int32)
    expected = (("out", out, f32, 3), ("q", q, f32, 3), ("k_cache", k_cache, f16, 4), ("v_cache", v_cache, f16, 4),
                ("block_tables", block_tables, i32, 2), ("context_lens", context_lens, i32, 1),
                ("query_starts", query_starts, i32, 1))  # fmt: skip
    for name, t, dtype, ndim in expected:
        if t.dtype != dtype or len(t.shape) != ndim:
            raise ValueError(f"attention: {name} must be {dtype} with {ndim} dims, got {t.dtype} {t.shape}")
    if out.shape != q.shape:
        raise ValueError(f"attention: out {out.shape} must match q {q.shape}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"attention: v_cache {v_cache.shape} must match k_cache {k_cache.shape}")
    num_seqs = block_tables.shape[0]
    if context_lens.shape != (num_seqs,) or query_starts.shape != (num_seqs + 1,):
        raise ValueError(
            f"attention: {num_seqs} block tables need context_lens [{num_seqs}] and query_starts [{num_seqs + 1}], "
            f"got {context_lens.shape} and {query_starts.shape}"
        )
