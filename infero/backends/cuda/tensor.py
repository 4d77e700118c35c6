"""DeviceTensor: a typed, shaped view of device memory (no ownership logic beyond keeping its owner alive)."""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass

import numpy as np

from infero.backends.cuda import driver
from infero.checkpoint.tensor_types import BLOCK_LAYOUTS


def nbytes_of(shape: tuple[int, ...], dtype) -> int:
    """Bytes of a tensor of this shape and dtype. math.prod, not np.prod: an eager forward pass asks this a few
    hundred times, and np.prod costs ~4 us a call (scripts/cuda_host_overhead.py)."""
    return int(math.prod(shape)) * np.dtype(dtype).itemsize


class DeviceTensor:
    """A view of device memory: its address, shape and dtype, and the allocation it keeps alive (owner). Treated as
    immutable, compared and hashed by (ptr, shape, dtype). A class with slots, not a frozen dataclass, whose
    __init__ took 0.53 us against 0.15: qwen3-30b-a3b's eager forward makes ~1,450 of them, and its host time with
    the GPU stubbed fell 8.1-8.4 -> 7.6-7.7 ms on the development machine (scripts/cuda_host_overhead.py)."""

    __slots__ = ("ptr", "shape", "dtype", "owner")

    def __init__(self, ptr: int, shape: tuple[int, ...], dtype: np.dtype, owner: object = None):
        self.ptr = ptr
        self.shape = shape
        self.dtype = dtype
        self.owner = owner

    def __eq__(self, other) -> bool:
        if type(other) is not DeviceTensor:
            return NotImplemented
        return (self.ptr, self.shape, self.dtype) == (other.ptr, other.shape, other.dtype)

    def __hash__(self) -> int:
        return hash((self.ptr, self.shape, self.dtype))

    def __repr__(self) -> str:
        return f"DeviceTensor(ptr={self.ptr:#x}, shape={self.shape}, dtype={self.dtype})"

    @property
    def numel(self) -> int:
        return int(math.prod(self.shape))  # math.prod: see nbytes_of

    @property
    def nbytes(self) -> int:
        return nbytes_of(self.shape, self.dtype)

    def reshape(self, *shape: int) -> DeviceTensor:
        if len(shape) == 1 and isinstance(shape[0], tuple):
            shape = shape[0]
        if -1 in shape:
            known = int(math.prod(s for s in shape if s != -1))
            shape = tuple(self.numel // known if s == -1 else s for s in shape)
        if math.prod(shape) != self.numel:
            raise ValueError(f"cannot reshape {self.shape} to {shape}")
        return DeviceTensor(self.ptr, tuple(shape), self.dtype, self.owner)

    def rows(self, start: int, stop: int) -> DeviceTensor:
        """Rows [start, stop) of the outermost dimension, as a view."""
        row_bytes = self.nbytes // self.shape[0]
        return DeviceTensor(self.ptr + start * row_bytes, (stop - start,) + self.shape[1:], self.dtype, self.owner)

    def to_host(self, stream: driver.Stream | None = None) -> np.ndarray:
        out = np.empty(self.shape, dtype=self.dtype)
        if stream is not None:
            stream.synchronize()
        driver.copy_device_to_host(out, self.ptr)
        return out

    @property
    def arg(self) -> tuple[int, type]:
        """(value, ctypes type) for a kernel launch."""
        return self.ptr, ctypes.c_void_p


@dataclass(frozen=True)
class Strided:
    """float32 rows x cols, row r starting `stride` elements after row r - 1: columns [start, start + cols) of a
    wider row-major matrix, read in place (no copy)."""

    tensor: DeviceTensor
    start: int
    rows: int
    cols: int
    stride: int

    @property
    def ptr(self) -> int:
        return self.tensor.ptr + 4 * self.start

    @property
    def dtype(self) -> np.dtype:
        return self.tensor.dtype


def columns(t: DeviceTensor, start: int, stop: int) -> Strided:
    """Columns [start, stop) of t's last dimension, every leading index a row: columns(qkv [n, C], 0, key_size) is
    q; columns(q_gate [n, heads, 2 head_dim], head_dim, 2 head_dim) each head's output gate."""
    width = t.shape[-1]
    if not 0 <= start <= stop <= width:
        raise ValueError(f"columns [{start}, {stop}) are not within a row of {width}")
    return Strided(t, start, t.numel // width if width else 0, stop - start, width)


def empty(shape: tuple[int, ...], dtype, arena: driver.Arena | None = None) -> DeviceTensor:
    nbytes = nbytes_of(shape, dtype)
    if arena is not None:
        return DeviceTensor(arena.allocate(nbytes), tuple(shape), np.dtype(dtype), arena)
    mem = driver.DeviceMemory(nbytes)
    return DeviceTensor(mem.ptr, tuple(shape), np.dtype(dtype), mem)


def from_host(array: np.ndarray, arena: driver.Arena | None = None) -> DeviceTensor:
    array = np.ascontiguousarray(array)
    t = empty(array.shape, array.dtype, arena)
    driver.copy_host_to_device(t.ptr, array)
    return t


class Workspace:
    """A bump allocator over one preallocated buffer, reset at the start of every forward pass.

    The same sequence of requests gets the same addresses every step, which is what lets a captured CUDA
    graph be replayed.
    """

    ALIGN = 256

    def __init__(self, nbytes: int):
        self.memory = driver.DeviceMemory(nbytes)
        self.offset = 0
        self.high_water = 0
        self.generation = 0  # counts resets: the same address in another step is another tensor

    def reset(self) -> None:
        self.offset = 0
        self.generation += 1

    def empty(self, shape: tuple[int, ...], dtype) -> DeviceTensor:
        # An eager forward pass carves ~25 tensors a layer: plain int arithmetic (scripts/cuda_host_overhead.py).
        start, align = self.offset, self.ALIGN
        end = start + ((nbytes_of(shape, dtype) + align - 1) // align * align or align)
        if end > self.memory.nbytes:
            raise MemoryError(f"workspace of {self.memory.nbytes:,} bytes exhausted (needs {end:,})")
        self.offset = end
        if end > self.high_water:
            self.high_water = end
        return DeviceTensor(self.memory.ptr + start, tuple(shape), np.dtype(dtype), self.memory)


# Bytes a superblock takes in the tiled layout (weight_layout.py, kernels/quant.cuh): Q4_K's 144; Q6_K's 210 and 6
# zero bytes, so that its superblocks start on 8-byte boundaries and a pair fills a 16-byte-aligned stage row.
TILED_SLOT_BYTES = {12: 144, 14: 216}


@dataclass(frozen=True)
class QuantWeight:
    """A weight matrix on the GPU in its GGUF encoding, [rows, cols] logical: rows of blocks of ggml_type as GGUF
    stores them, or, tiled, a Q4_K or Q6_K matrix's blocks in the order the decode mat-vecs stream fastest
    (weight_layout.py)."""

    data: DeviceTensor  # uint8 [rows, row_bytes]; tiled: row_bytes = superblocks x TILED_SLOT_BYTES
    ggml_type: int
    rows: int
    cols: int
    tiled: bool = False

    @property
    def nbytes(self) -> int:
        """The matrix's encoded bytes, GGUF's (a tiled Q6_K matrix stores 216 for each superblock's 210)."""
        layout = BLOCK_LAYOUTS[self.ggml_type]
        return self.rows * (self.cols // layout.elements) * layout.bytes

    def layout_error(self, supported, tiled_ok: bool = False) -> str | None:
        """What is wrong with the stored blocks for a kernel taking the `supported` types (and, tiled_ok, the tiled
        layout), or None."""
        t, rows, cols = self.ggml_type, self.rows, self.cols
        if t not in supported:
            return f"GGML type {t} is not supported"
        layout = BLOCK_LAYOUTS[t]  # keyed by GGMLType, an IntEnum: its int finds it
        if cols % layout.elements:
            return f"type {t} needs a row length divisible by {layout.elements}, got {cols}"
        if self.tiled and not tiled_ok:
            return "this kernel reads GGUF rows, not the tiled layout"
        if self.tiled and (t not in TILED_SLOT_BYTES or rows % 16 or cols % 512):
            return f"the tiled layout holds Q4_K or Q6_K of 16-row tiles and superblock pairs, not type {t} " \
                   f"[{rows}, {cols}]"  # fmt: skip
        block_bytes = TILED_SLOT_BYTES[t] if self.tiled else layout.bytes
        if self.data.shape != (rows, cols // layout.elements * block_bytes) or self.data.dtype != np.uint8:
            return f"data {self.data.dtype} {self.data.shape} does not hold [{rows}, {cols}] of type {t}"
        if self.data.ptr % 16:
            return "weight data must be 16-byte aligned"
        return None
