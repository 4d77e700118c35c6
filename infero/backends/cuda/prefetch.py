"""L2 prefetch of the next weights, carried by the small kernel before the mat-vec that reads them
(kernels/prefetch.cuh): while a norm or SwiGLU runs, DRAM would otherwise idle.

`plan(weights)` says what to prefetch: the first MAX_BYTES of the matrices in the order the next launch reads them
(a mat-vec launch walks its matrices, and each matrix's rows, in order). The launchers of add_rms_norm and swiglu
take the plan and add its CTAs to their grid.
"""

from __future__ import annotations

import ctypes

RANGES = 4  # prefetch.cuh's PREFETCH_RANGES
BLOCKS = 32  # extra CTAs per prefetching launch: each issues its share of 4 KiB bulk prefetches
# Bytes per launch: the H200 has 50 MB of L2, and what the kernels between the prefetch and its reader stream
# (attention's K/V, the q/k/v mat-vec before the o projection) must not evict it first.
MAX_BYTES = 32 << 20
# Steps up to this many tokens stream their weights (mat-vec, skinny GEMM); beyond, GEMMs are compute-bound and an
# eager prefill would only pay the extra launch arguments.
MAX_TOKENS = 64
EARLY = False  # prefetch before the previous kernel completes (prefetch.cuh); a knob for scripts/ab_prefetch.py

_P, _L, _I = ctypes.c_void_p, ctypes.c_longlong, ctypes.c_int


class Prefetch(ctypes.Structure):
    """prefetch.cuh's Prefetch, passed by value; all zeros: no prefetch."""

    _fields_ = [("ptr", _P * RANGES), ("bytes", _L * RANGES), ("first_block", _I), ("blocks", _I), ("early", _I)]


NONE = Prefetch()


def plan(weights) -> Prefetch | None:
    """The first MAX_BYTES of the weights' stored bytes (QuantWeights, in reading order), or None for nothing."""
    pf, used, budget = Prefetch(), 0, MAX_BYTES
    for w in weights:
        nbytes = min(w.nbytes, budget) // 16 * 16
        if used == RANGES or nbytes <= 0:
            break
        if w.data.ptr % 16:  # the bulk prefetch takes 16-byte aligned ranges; weights are, as the arena places them
            continue
        pf.ptr[used], pf.bytes[used] = w.data.ptr, nbytes
        used, budget = used + 1, budget - nbytes
    if used == 0:
        return None
    pf.blocks, pf.early = BLOCKS, int(EARLY)
    return pf


def for_launch(pf: Prefetch | None, own_blocks: int) -> tuple[Prefetch, int]:
    """The struct to pass to a kernel whose own grid is own_blocks CTAs, and the grid to launch."""
    if pf is None:
        return NONE, own_blocks
    pf.first_block = own_blocks
    return pf, own_blocks + pf.blocks
