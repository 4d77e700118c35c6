"""A GGUF reader: header, metadata and tensor directory parsed from a memory map, tensor bytes left in place.

The `gguf` package's reader builds numpy views for every field and takes seconds on a 49k-token vocabulary;
this one decodes strings with one `struct` call each and numeric arrays with `np.frombuffer`, so a model's
header and vocabulary parse in tens of milliseconds. Tensor data are zero-copy views of the map.
"""

from __future__ import annotations

import math
import mmap
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from infero.checkpoint.tensor_types import BLOCK_LAYOUTS, GGMLType, type_name
from infero.errors import ModelFileError, excerpt

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# GGUF metadata value types -> (struct code, numpy dtype) for scalars.
_SCALARS = {
    0: ("<B", np.uint8),
    1: ("<b", np.int8),
    2: ("<H", np.uint16),
    3: ("<h", np.int16),
    4: ("<I", np.uint32),
    5: ("<i", np.int32),
    6: ("<f", np.float32),
    7: ("<?", np.bool_),
    10: ("<Q", np.uint64),
    11: ("<q", np.int64),
    12: ("<d", np.float64),
}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a GGUF file: its name, type and shape (numpy order, outermost first) and its bytes."""

    name: str
    ggml_type: int
    shape: tuple[int, ...]
    data: np.ndarray  # uint8 view into the memory map, exactly nbytes long

    @property
    def type_name(self) -> str:
        return type_name(self.ggml_type)

    @property
    def num_elements(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


# llama.cpp reads no arrays of arrays at all; we read them a few levels deep, no further.
MAX_ARRAY_NESTING = 4
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_COUNT = 1_000_000  # tensors or metadata keys in one file; a larger count is corruption


class _Cursor:
    """Reads little-endian GGUF values from a buffer; raises ModelFileError on reading past the end."""

    def __init__(self, buf: memoryview, path: Path, version: int):
        self.buf, self.pos, self.path, self.version = buf, 0, path, version
        self.width = 4 if version == 1 else 8  # GGUF v1 stored lengths and counts as uint32; v2 and v3 as uint64

    def _need(self, n: int) -> None:
        if self.pos + n > len(self.buf):
            raise ModelFileError(
                f"{self.path}: truncated GGUF header (needs byte {self.pos + n:,}, file has {len(self.buf):,})"
            )

    def scalar(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        self._need(size)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def count(self) -> int:
        return self.scalar("<I" if self.version == 1 else "<Q")

    def string(self) -> str:
        n = self.count()
        self._need(n)
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def strings(self, n: int) -> list[str]:
        self._need(n * self.width)  # every string holds at least its length
        out = []
        buf, pos, end = self.buf, self.pos, len(self.buf)
        unpack = struct.Struct("<I" if self.version == 1 else "<Q").unpack_from
        for _ in range(n):
            if pos + self.width > end:
                self.pos = pos
                self._need(self.width)
            (length,) = unpack(buf, pos)
            pos += self.width
            if pos + length > end:
                self.pos = pos
                self._need(length)
            out.append(str(buf[pos : pos + length], "utf-8", "replace"))
            pos += length
        self.pos = pos
        return out

    def value(self, value_type: int, depth: int = 0) -> Any:
        if value_type in _SCALARS:
            return self.scalar(_SCALARS[value_type][0])
        if value_type == _STRING:
            return self.string()
        if value_type != _ARRAY:
            raise ModelFileError(f"{self.path}: unknown GGUF metadata value type {value_type} at byte {self.pos:,}")
        if depth == MAX_ARRAY_NESTING:
            raise ModelFileError(
                f"{self.path}: metadata arrays nested deeper than {MAX_ARRAY_NESTING} at byte {self.pos:,}"
            )
        elem_type = self.scalar("<I")
        n = self.count()
        if elem_type in _SCALARS:
            dtype = np.dtype(_SCALARS[elem_type][1]).newbyteorder("<")
            self._need(n * dtype.itemsize)
            arr = np.frombuffer(self.buf, dtype=dtype, count=n, offset=self.pos).copy()
            self.pos += n * dtype.itemsize
            return arr
        if elem_type == _STRING:
            return self.strings(n)
        if elem_type != _ARRAY:
            raise ModelFileError(f"{self.path}: unknown GGUF array element type {elem_type} at byte {self.pos:,}")
        self._need(n * (4 + self.width))  # every array holds at least its element type and count
        return [self.value(_ARRAY, depth + 1) for _ in range(n)]


class GGUFFile:
    """One memory-mapped GGUF file: `metadata` (key -> value), `tensors` (name -> TensorInfo), `version`."""

    def __init__(
        self, path: Path, version: int, metadata: dict[str, Any], tensors: dict[str, TensorInfo], mm: mmap.mmap
    ):
        self.path, self.version, self.metadata, self.tensors = path, version, metadata, tensors
        self._mmap = mm  # kept alive: tensor views point into it

    @classmethod
    def open(cls, path: str | os.PathLike) -> GGUFFile:
        path = Path(path)
        if not path.exists():
            raise ModelFileError(f"{path}: no such file")
        if path.is_dir():
            raise ModelFileError(f"{path}: is a directory; pass the .gguf file")
        size = path.stat().st_size
        if size < 24:
            raise ModelFileError(f"{path}: not a GGUF file ({size} bytes)")
        with open(path, "rb") as f:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        buf = memoryview(mm)
        if bytes(buf[:4]) != GGUF_MAGIC:
            raise ModelFileError(f"{path}: not a GGUF file (magic {bytes(buf[:4])!r}, expected b'GGUF')")
        (version,) = struct.unpack_from("<I", buf, 4)
        if version not in (1, 2, 3):
            raise ModelFileError(f"{path}: GGUF version {version} is not supported (1, 2 and 3 are)")
        cur = _Cursor(buf, path, version)
        cur.pos = 8
        n_tensors, n_kv = cur.count(), cur.count()
        if n_tensors > MAX_COUNT or n_kv > MAX_COUNT:
            raise ModelFileError(f"{path}: corrupt GGUF header ({n_tensors:,} tensors, {n_kv:,} metadata keys)")
        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            if key in metadata:
                raise ModelFileError(f"{path}: metadata key {excerpt(key)} appears twice")
            metadata[key] = cur.value(cur.scalar("<I"))
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.scalar("<I")
            if n_dims > MAX_DIMS:
                raise ModelFileError(f"{path}: tensor {excerpt(name)} has {n_dims:,} dimensions (at most {MAX_DIMS})")
            dims = [cur.count() for _ in range(n_dims)]
            infos.append((name, tuple(reversed(dims)), cur.scalar("<I"), cur.scalar("<Q")))
        alignment = _alignment(path, metadata)
        data_start = -(-cur.pos // alignment) * alignment
        tensors = {}
        for name, shape, ggml_type, offset in infos:
            if name in tensors:
                raise ModelFileError(f"{path}: tensor {excerpt(name)} appears twice")
            if offset % alignment:
                raise ModelFileError(f"{path}: tensor {excerpt(name)} starts at offset {offset:,}, not a multiple of "
                                     f"the file's alignment {alignment}")  # fmt: skip
            nbytes = _tensor_nbytes(path, name, shape, ggml_type)
            start = data_start + offset
            if start + nbytes > size:
                raise ModelFileError(
                    f"{path}: truncated file: tensor {excerpt(name)} needs bytes up to {start + nbytes:,}, "
                    f"the file has {size:,}"
                )
            data = np.frombuffer(mm, dtype=np.uint8, count=nbytes, offset=start)
            tensors[name] = TensorInfo(name, ggml_type, shape, data)
        return cls(path, version, metadata, tensors, mm)


def _alignment(path: Path, metadata: dict[str, Any]) -> int:
    value = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0 or value & (value - 1):
        raise ModelFileError(f"{path}: general.alignment must be a power of two; the file says {excerpt(value)}")
    return value


def _tensor_nbytes(path: Path, name: str, shape: tuple[int, ...], ggml_type: int) -> int:
    try:
        layout = BLOCK_LAYOUTS[GGMLType(ggml_type)]
    except (ValueError, KeyError):
        raise ModelFileError(f"{path}: tensor {excerpt(name)} has unknown GGML type {ggml_type}") from None
    # Python integers, so a corrupt dimension cannot wrap around to a small size (llama.cpp's INT64_MAX bound).
    elements = math.prod(shape)
    if elements >= 2**63 // layout.bytes:
        raise ModelFileError(f"{path}: tensor {excerpt(name)} has an impossible shape {shape}")
    row = shape[-1] if shape else 1
    if row % layout.elements:
        raise ModelFileError(
            f"{path}: tensor {excerpt(name)} row of {row} is not a multiple of the {type_name(ggml_type)} block"
        )
    return elements // layout.elements * layout.bytes


_SPLIT_NAME = re.compile(r"^(?P<prefix>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def split_paths(path: str | os.PathLike) -> list[Path]:
    """All files of a split model (`name-00001-of-00003.gguf` ...) given any one of them; [path] otherwise."""
    path = Path(path)
    m = _SPLIT_NAME.match(path.name)
    if not m:
        return [path]
    count = int(m["count"])
    paths = [path.with_name(f"{m['prefix']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [p.name for p in paths if not p.exists()]
    if missing:
        raise ModelFileError(f"{path}: split model is missing {', '.join(missing)}")
    return paths


class GGUFModel:
    """A model stored in one GGUF file or split across several: metadata from the first, tensors from all."""

    def __init__(self, files: list[GGUFFile]):
        self.files = files
        self.path = files[0].path
        self.metadata = files[0].metadata
        self.tensors: dict[str, TensorInfo] = {}
        for f in files:
            self.tensors.update(f.tensors)
        expected = self.metadata.get("split.tensors.count")
        if expected is not None and (not isinstance(expected, int) or expected != len(self.tensors)):
            raise ModelFileError(
                f"{self.path}: split model declares {excerpt(expected)} tensors but its files hold {len(self.tensors)}"
            )

    @classmethod
    def open(cls, path: str | os.PathLike) -> GGUFModel:
        return cls([GGUFFile.open(p) for p in split_paths(path)])

    @property
    def file_size(self) -> int:
        return sum(f.path.stat().st_size for f in self.files)
