"""Launcher for kernels/l2_prefetch.cu, and the side branch of a captured decode step that runs it.

While a decode step is captured into a graph, each mat-vec launch (matvec.py calls ahead_of) forks a prefetch of
its matrices' first PREFETCH_BYTES onto a second, high-priority stream, made to depend on the mat-vec launched just
before this one (PREFETCH_AFTER) or on the kernel before that one. So the prefetch of matrix j runs while the small
kernels between j - 1 and j (attention, norms, SwiGLU) leave DRAM idle (or also while j - 1 streams), and matrix j
starts on L2 hits. The branch joins the step's stream at the end of the capture; nothing in the step waits on it.
Eager steps never prefetch.

Measured on the H200 (docs/performance.md) and not adopted: llama-3.1-8b's step -34.5 us at 8 MiB after the
previous mat-vec in one process's A/B, inconclusive across processes; more bytes, or prefetching while the previous
matrix streams, made it slower (the prefetched lines are evicted before use).
"""

from __future__ import annotations

import contextlib
import ctypes
import threading

from infero.backends.cuda import driver, runtime

SOURCE = "l2_prefetch.cu"
MAX_RANGES = 3  # kernels/l2_prefetch.cu's pf::MAX_RANGES: one launch per mat-vec launch, whose matrices are <= 3
# Bytes of each mat-vec launch's matrices (in launch order) prefetched ahead of it; 0 turns the branch off.
PREFETCH_BYTES = 8 << 20
PREFETCH_MODE = 0  # the kernel's mode: 0 bulk, 1 per 32-byte sector, 2 per sector with evict_last
# 0: the prefetch of matrix j depends on the kernel before matrix j - 1 (it overlaps j - 1's stream); 1: on matrix
# j - 1 itself (it fills only the gap of small kernels between them).
PREFETCH_AFTER = 1
THREADS = {0: 32, 1: 128, 2: 128}

runtime.declare(SOURCE, ["l2_prefetch"])

_P, _L, _I = ctypes.c_void_p, ctypes.c_longlong, ctypes.c_int


class Ranges(ctypes.Structure):
    """kernels/l2_prefetch.cu's pf::Ranges, passed by value (unused ranges: 0 bytes)."""

    _fields_ = [("ptr", _P * MAX_RANGES), ("bytes", _L * MAX_RANGES)]


_branch = threading.local()  # the SideBranch of the capture running on this thread, if any
_streams: list[driver.Stream] = []


class SideBranch:
    """The prefetch branch of one capture: see the module docstring."""

    def __init__(self, main: driver.Stream, nbytes: int, mode: int):
        if not _streams:
            _streams.append(driver.Stream(high_priority=True))
        self.main, self.side, self.nbytes, self.mode = main, _streams[0], nbytes, mode
        self.fork = driver.Event(timing=False)  # recorded before each mat-vec launch: the kernel before it
        self.forked = self.join_needed = False

    def ahead_of(self, weights) -> None:
        if self.forked:
            self.side.wait(self.fork)
            ranges, budget = Ranges(), self.nbytes
            for i, w in enumerate(weights[:MAX_RANGES]):
                take = min(w.data.nbytes, budget) // 16 * 16
                ranges.ptr[i], ranges.bytes[i] = w.data.ptr, take
                budget -= take
            grid = runtime.context().info.num_sms
            driver.launch(runtime.kernel(SOURCE, "l2_prefetch"), (grid,), (THREADS[self.mode],),
                          (ranges, self.mode), (None, _I), self.side)  # fmt: skip
            self.join_needed = True
        if not PREFETCH_AFTER:
            self.fork.record(self.main)
            self.forked = True

    def launched(self) -> None:
        if PREFETCH_AFTER:
            self.fork.record(self.main)
            self.forked = True

    def join(self) -> None:
        if self.join_needed:
            done = driver.Event(timing=False)
            done.record(self.side)
            self.main.wait(done)


@contextlib.contextmanager
def branch(main: driver.Stream):
    """Around a decode step's capture on `main`: mat-vec launches inside prefetch ahead (PREFETCH_BYTES > 0)."""
    if PREFETCH_BYTES <= 0:
        yield
        return
    side = _branch.current = SideBranch(main, PREFETCH_BYTES, PREFETCH_MODE)
    try:
        yield
    finally:
        _branch.current = None
        side.join()


def ahead_of(weights) -> None:
    """Called by a mat-vec launcher just before it launches on these weights (block-format QuantWeights)."""
    side = getattr(_branch, "current", None)
    if side is not None:
        side.ahead_of(weights)


def launched() -> None:
    """Called by a mat-vec launcher just after its launch."""
    side = getattr(_branch, "current", None)
    if side is not None:
        side.launched()
