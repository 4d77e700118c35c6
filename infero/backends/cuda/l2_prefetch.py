"""Gate + up's first tiles into the L2 while a decode step's attention runs (kernels/l2_prefetch.cu).

Attention and its split merge leave the DRAM nearly idle for ~10 us a layer of llama-3.1-8b's batch-1 step on the
H200; gate + up after them then streams 66 MB, every one of its blocks starting on DRAM misses. While a decode step
is captured, CudaOps.prefetch_gate_up forks a prefetch onto a side stream after the kernels queued before attention:
of every matvec_glu block's four tiles (groups of 8 rows of gate and of up) the first GATE_UP_TILES, at most
L2_SHARE of the L2 in all (more evicts itself before gate + up reads it). The branch joins the step's stream at the
end of the capture, so no kernel of the step waits on it. Eager steps, and GPUs before sm_90 (no bulk prefetch),
never prefetch. Measured on the H200 (docs/performance.md, the twentieth session): ~10 us off the 8B's ~1,970 us
step, its variants (more tiles, o too, other issue patterns, other fork points) even or slower.
"""

from __future__ import annotations

import contextlib
import ctypes

from infero.backends.cuda import driver, runtime
from infero.backends.cuda.tensor import QuantWeight

SOURCE = "l2_prefetch.cu"
GATE_UP_TILES = 2  # of each matvec_glu block's 4 tiles; 0 turns the prefetch off
L2_SHARE = 0.55  # the most of the L2 a layer's prefetch may fill
GLU_TILES, GLU_ROWS = 4, 32  # matvec_glu: a block's 32 rows, as 4 tiles of 8
# One bulk prefetch a thread, 32 a CTA (the kernel's bounds): 28 CTAs for the 8B. Measured slower: a tile a thread in
# 56 or 448 CTAs, a block's take a thread in 14 or 7 CTAs of 64 or 128.
THREADS = 32
runtime.declare(SOURCE, ["l2_prefetch_chunks"])

_P, _L, _U, _I = ctypes.c_void_p, ctypes.c_longlong, ctypes.c_uint, ctypes.c_int


class Branch:
    """The side stream of one backend's captured steps and the fork and join events that tie it into the graph."""

    def __init__(self):
        self._side: driver.Stream | None = None
        self._fork = self._join = None
        self._main: driver.Stream | None = None
        self._forked = False

    @contextlib.contextmanager
    def capturing(self, main: driver.Stream):
        """Around a decode step's capture on `main`: ahead() calls inside fork onto the side stream, which joins
        `main` when the block ends (a capture must end with every stream it forked joined back)."""
        if self._side is None:
            self._side = driver.Stream()
            self._fork, self._join = driver.Event(timing=False), driver.Event(timing=False)
        self._main, self._forked = main, False
        try:
            yield
        finally:
            main, forked = self._main, self._forked
            self._main, self._forked = None, False
            if forked:
                self._join.record(self._side)
                main.wait(self._join)

    def ahead(self, gate: QuantWeight, up: QuantWeight) -> None:
        """Prefetch gate + up's first tiles of each of matvec_glu's blocks, after the kernels `main` has queued so
        far; nothing outside a capture or before sm_90."""
        if self._main is None:
            return
        info = runtime.context().info
        rows, row_bytes = gate.data.shape
        chunks, stride = rows // GLU_ROWS, GLU_ROWS * row_bytes
        if info.capability < (9, 0) or rows % GLU_ROWS or up.data.shape != gate.data.shape or stride % 16:
            return
        take = min(GATE_UP_TILES * stride // GLU_TILES, int(L2_SHARE * info.l2_bytes) // (2 * chunks)) // 16 * 16
        if take <= 0:
            return
        self._fork.record(self._main)
        self._side.wait(self._fork)
        driver.launch(runtime.kernel(SOURCE, "l2_prefetch_chunks"), (-(-2 * chunks // THREADS),), (THREADS,),
                      (gate.data.ptr, up.data.ptr, stride, take, chunks), (_P, _P, _L, _U, _I), self._side)  # fmt: skip
        self._forked = True
