"""Paged causal grouped-query attention over the fp16 KV cache (kernels/attention.cu).

Both kernels compute one definition (batch invariance rule 3, kernels/attention.cu's header): a query row's output
is the left fold, in position order, of its 64-key tiles' partials anchored at position 0, then O / l. Prefill
chunks (two or more new tokens) fold every tile in registers. Decode sequences (one new token) spread their tiles
over the CTAs a launch gives each (sequence, kv head), chosen from the batch to fill one wave (decode_splits); a CTA
that takes all of a sequence's tiles folds them itself, otherwise each tile is written as a partial and a second
kernel folds them in order: the same bits either way, so a query's bits depend neither on the batch, nor on the
CTAs, nor on whether its token was decoded or prefilled. A mixed batch launches both kernels; each skips the
other's sequences. Both kernels double-buffer their K/V tiles where two stages fit the GPU's shared memory, else
take one (head dim 256 on GPUs that let a block opt in to less than 132 KiB: sm_86, sm_89, sm_120); the stages
change when a tile loads, never the arithmetic, so the bits do not depend on the GPU.
"""

from __future__ import annotations

import ctypes

import numpy as np

from infero.backends.cuda import driver, matvec, runtime
from infero.backends.cuda.tensor import DeviceTensor, Workspace

FILE = "attention.cu"
HEAD_DIMS = (64, 128, 256)
# How many of a decode launch's CTAs each SM holds at once (0: one CTA per (sequence, kv head), never split); None:
# what the occupancy calculator says for the kernel (3 at head dim 128 on the H200).
DECODE_CTAS_PER_SM: int | None = None
_BLOCK_N = 64  # keys a tile, must match kernels/attention.cu
# Bytes of tile partials a decode launch may borrow from the workspace: a sequence with more tiles than the launch has
# slots for is folded by one CTA (the same bits, less parallel). 64 sequences x 32 heads x 16 tiles of head dim 128
# fit; a batch-1 step of llama-3.1-8b's shape fits 2,016 tiles (129,024 keys).
PARTIALS_BYTES = 32 << 20
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
_ATTENTION_TYPES = (_P,) * 9 + (_I,) * 6 + (ctypes.c_float, _P, _P, _I)  # ATTENTION_PARAMS
_MERGE_TYPES = (_P,) * 5 + (_I,) * 2 + (_P, _P, _I)
_LOG2E = 1.4426950408889634
_functions: dict[tuple[str, int, int], object] = {}
runtime.on_reload(_functions.clear)
_num_sms: list[int] = []
_resident: dict = {}  # decode kernel -> its CTAs an SM holds at once
runtime.on_reload(_resident.clear)
_shared_optin: list[int] = []


def key_tiles(context_len: int) -> int:
    """The 64-key tiles a context of context_len keys folds (at least one)."""
    return max(1, -(-context_len // _BLOCK_N))


def partial_tiles(num_seqs: int, num_heads: int, head_dim: int, max_context_len: int) -> int:
    """Tile slots per (sequence, head) of a decode launch whose CTAs split sequences: as many as max_context_len
    needs, within PARTIALS_BYTES (each slot head_dim floats of O and an (m, l) pair)."""
    fit = PARTIALS_BYTES // (num_seqs * num_heads * (head_dim + 2) * 4)
    return min(key_tiles(max_context_len), fit)


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
    NaN); a captured graph may pass a fixed bound: it sizes the tile partials' slots (within PARTIALS_BYTES) and
    grows the grid only up to a tile for each CTA the batch fills the GPU with.
    num_decode_seqs: how many sequences have exactly one new token, or None if unknown; 0 with
    max_query_len > 1 skips the decode launch. quantized: (xq int8, xs int32) of
    matvec.activation_shapes(num_tokens, num_heads * head_dim) to receive out in the mat-vec's activation format
    as well (kernels/act_quant.cuh), only where every token is a decode token (max_query_len 1). Where the decode
    launch splits sequences over CTAs it borrows the tile partials from the workspace (float32 [num_seqs, num_heads,
    tiles, head_dim] and their (m, l) pairs, tiles = partial_tiles(...), at most PARTIALS_BYTES) and hands them back
    before returning (stream order makes the reuse safe); never synchronizes.
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
            num_heads, num_kv_heads, block_size, max_blocks, key_tiles(max_context_len), 0, scale * _LOG2E, xq, xs,
            num_tokens]  # fmt: skip
    stages = _stages(head_dim)
    smem = tile_shared_bytes(head_dim, stages)

    if max_query_len > 1:
        grid = (-(-max_query_len * group // _ROWS_PREFILL), num_kv_heads, num_seqs)
        fn = _function("prefill", head_dim, stages)
        driver.launch(fn, grid, (prefill_threads(head_dim),), tuple(args), _ATTENTION_TYPES, stream, smem, pdl=True)
        if num_decode_seqs == 0:
            return

    row_tiles = -(-group // _ROWS_DECODE)
    decode = _function("decode", head_dim, stages)
    ctas = decode_splits(num_seqs * num_kv_heads * row_tiles, key_tiles(max_context_len), _slots(decode, smem))
    part_tiles = partial_tiles(num_seqs, num_heads, head_dim, max_context_len) if ctas > 1 else 0
    if part_tiles < 2:  # no sequence of more than one tile could be split: one CTA folds each
        ctas, part_tiles = 1, 0
    mark = workspace.offset
    if part_tiles:
        part_out = workspace.empty((num_seqs, num_heads, part_tiles, head_dim), np.float32)
        part_ml = workspace.empty((num_seqs, num_heads, part_tiles, 2), np.float32)
        args[7], args[8] = part_out.ptr, part_ml.ptr
    args[14] = part_tiles
    grid = (ctas, num_kv_heads, num_seqs * row_tiles)
    driver.launch(decode, grid, (128,), tuple(args), _ATTENTION_TYPES, stream, smem, pdl=True, carveout=True)
    if part_tiles:
        merge_args = (out.ptr, part_out.ptr, part_ml.ptr, context_lens.ptr, query_starts.ptr, num_heads, part_tiles,
                      xq, xs, num_tokens)  # fmt: skip
        driver.launch(_function("merge_splits", head_dim), (num_heads, num_seqs), (head_dim,), merge_args,
                      _MERGE_TYPES, stream, pdl=True)  # fmt: skip
    workspace.offset = mark  # the partials are dead once the merge (queued on this stream) has run


def decode_splits(units: int, tiles: int, slots: int) -> int:
    """CTAs a decode launch gives each of its `units` (sequence, kv head, row tile) of up to `tiles` key tiles, where
    `slots` CTAs fit on the GPU at once: as many as fit in one wave, but one where the units alone fill half of it.
    A split costs its tile partials' write and read and the merge launch, and a wave more leaves SMs idle at its
    tail: on the H200 (scripts/bench_attention.py, 2026-12-04) qwen3-30b-a3b's 32 sequences of 512 keys took 23.8
    us in 3 splits (one wave) against 28.7 in 4 (1.3 waves), llama-3.1-8b's 32 x 512 37.6 unsplit against 46.6 in
    2, and 64 x 512 38.0 unsplit against 52.4 in 2 (docs/performance.md)."""
    if slots <= 0 or 2 * units > slots:
        return 1
    return max(1, min(tiles, slots // units))


def _slots(decode, smem: int) -> int:
    """Decode CTAs the GPU holds at once: DECODE_CTAS_PER_SM, or the occupancy calculator's count, per SM."""
    if DECODE_CTAS_PER_SM is not None:
        return DECODE_CTAS_PER_SM * _sm_count()
    if decode not in _resident:
        _resident[decode] = driver.resident_blocks_per_sm(decode, 128, smem)
    return _resident[decode] * _sm_count()


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
