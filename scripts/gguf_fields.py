"""GGUF files as typed fields, for writing hostile files: parse a well-formed file, edit it, write it back.

infero's reader keeps values and drops their GGUF types; a crafted file needs them (an alignment stored as a string,
a count stored as int64 -1, an array nested 3,000 deep), so this codec keeps every value as (type, value). It is for
tests and scripts/fuzz_gguf.py only: it trusts the file it parses.

The seed (`tiny_seed`) is the default model's header (its metadata: tokenizer, chat template, names) with the
hyperparameters of a 2-layer model and tensors of that size, so a hostile variant of it is a few MB and runs.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY, UINT64, INT64, FLOAT64 = range(13)
SCALAR_FORMATS = {UINT8: "<B", INT8: "<b", UINT16: "<H", INT16: "<h", UINT32: "<I", INT32: "<i", FLOAT32: "<f",
                  BOOL: "<?", UINT64: "<Q", INT64: "<q", FLOAT64: "<d"}  # fmt: skip
DTYPES = {t: np.dtype(f) for t, f in SCALAR_FORMATS.items()}


@dataclass
class Value:
    """One metadata value: a scalar, a str (or raw bytes), or an array (elem_type, list of items: scalars, str or
    bytes, or Values of type ARRAY)."""

    type: int
    value: object
    elem_type: int | None = None  # arrays only


@dataclass
class Tensor:
    name: str
    dims: list[int]  # GGUF order: innermost first
    ggml_type: int
    data: bytes


@dataclass
class GGUFFields:
    metadata: dict[str, Value] = field(default_factory=dict)
    tensors: list[Tensor] = field(default_factory=list)
    version: int = 3
    alignment: int = 32


class _Reader:
    def __init__(self, buf: bytes):
        self.buf, self.pos = buf, 0

    def take(self, fmt: str):
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return v

    def string(self) -> str:
        n = self.take("<Q")
        self.pos += n
        return self.buf[self.pos - n : self.pos].decode()

    def value(self, vtype: int) -> Value:
        if vtype in SCALAR_FORMATS:
            return Value(vtype, self.take(SCALAR_FORMATS[vtype]))
        if vtype == STRING:
            return Value(STRING, self.string())
        elem, n = self.take("<I"), self.take("<Q")
        if elem in DTYPES:
            items = np.frombuffer(self.buf, DTYPES[elem], n, self.pos).copy()
            self.pos += n * DTYPES[elem].itemsize
        elif elem == STRING:
            items = [self.string() for _ in range(n)]
        else:
            items = [self.value(ARRAY) for _ in range(n)]
        return Value(ARRAY, items, elem)


def parse(path: Path) -> GGUFFields:
    """The fields of a well-formed GGUF v3 file (values, types, tensors with their bytes)."""
    buf = Path(path).read_bytes()
    r = _Reader(buf)
    assert buf[:4] == b"GGUF" and struct.unpack_from("<I", buf, 4)[0] == 3
    r.pos = 8
    n_tensors, n_kv = r.take("<Q"), r.take("<Q")
    out = GGUFFields()
    for _ in range(n_kv):
        key = r.string()
        out.metadata[key] = r.value(r.take("<I"))
    infos = []
    for _ in range(n_tensors):
        name = r.string()
        dims = [r.take("<Q") for _ in range(r.take("<I"))]
        infos.append((name, dims, r.take("<I"), r.take("<Q")))
    if "general.alignment" in out.metadata:
        out.alignment = int(out.metadata["general.alignment"].value)
    start = -(-r.pos // out.alignment) * out.alignment
    ends = sorted(offset for *_, offset in infos)[1:] + [len(buf) - start]
    end_of = dict(zip(sorted(offset for *_, offset in infos), ends, strict=True))
    for name, dims, ggml_type, offset in infos:
        out.tensors.append(Tensor(name, dims, ggml_type, buf[start + offset : start + end_of[offset]]))
    return out


def scalar_bytes(v: Value) -> bytes:
    if v.type == FLOAT32:  # numpy rounds a value past float32's range to infinity; struct refuses it
        with np.errstate(over="ignore"):
            return np.array(v.value, "<f4").tobytes()
    return struct.pack(SCALAR_FORMATS[v.type], v.value)


def serialize(f: GGUFFields, slots: list[tuple[int, int]] | None = None) -> bytes:
    """The file's bytes: header, metadata, tensor directory, padding, tensor data (each aligned). `slots`, if
    given, receives (offset, width) of every count, length, type tag, dimension and offset in the header."""
    out = bytearray(b"GGUF" + struct.pack("<I", f.version))

    def num(fmt: str, value: int) -> None:
        if slots is not None:
            slots.append((len(out), struct.calcsize(fmt)))
        out.extend(struct.pack(fmt, value))

    def string(s: str | bytes) -> None:
        raw = s.encode() if isinstance(s, str) else s
        num("<Q", len(raw))
        out.extend(raw)

    def value(v: Value) -> None:
        stack = [v]  # not recursive: a hostile file may nest arrays thousands deep
        while stack:
            v = stack.pop()
            if v.type == STRING:
                string(v.value)
            elif v.type != ARRAY:
                out.extend(scalar_bytes(v))
            else:
                num("<I", v.elem_type)
                num("<Q", len(v.value))
                if v.elem_type in DTYPES:
                    with np.errstate(over="ignore"):
                        out.extend(np.asarray(v.value, DTYPES[v.elem_type]).tobytes())
                elif v.elem_type == STRING:
                    for s in v.value:
                        string(s)
                else:
                    stack.extend(reversed(v.value))  # an element array: its type and count, no tag

    num("<Q", len(f.tensors))
    num("<Q", len(f.metadata))
    for key, v in f.metadata.items():
        string(key)
        num("<I", v.type)
        value(v)
    offset, data = 0, []
    for t in f.tensors:
        string(t.name)
        num("<I", len(t.dims))
        for d in t.dims:
            num("<Q", d)
        num("<I", t.ggml_type)
        num("<Q", offset)
        pad = -len(t.data) % f.alignment
        data += [t.data, b"\0" * pad]
        offset += len(t.data) + pad
    out.extend(b"\0" * (-len(out) % f.alignment))
    return bytes(out) + b"".join(data)


def write(f: GGUFFields, path: Path) -> Path:
    Path(path).write_bytes(serialize(f))
    return Path(path)


# The seed's shape: small enough to build and run in milliseconds, with GQA (4 heads over 2 KV heads).
SEED_HYPERPARAMETERS = {"block_count": 2, "embedding_length": 64, "feed_forward_length": 128,
                        "attention.head_count": 4, "attention.head_count_kv": 2, "rope.dimension_count": 16,
                        "context_length": 256}  # fmt: skip


def tiny_seed(default_model: Path, seed: int = 0) -> GGUFFields:
    """The default model's metadata with SEED_HYPERPARAMETERS, and random tensors of those shapes (the embedding
    in Q8_0, the rest F32; tied output)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    src = parse(default_model)
    arch = src.metadata["general.architecture"].value
    for key, value in SEED_HYPERPARAMETERS.items():
        src.metadata[f"{arch}.{key}"] = Value(UINT32, value)
    d, ffn, heads, kv = 64, 128, 4, 2
    head_dim = d // heads
    vocab = len(src.metadata["tokenizer.ggml.tokens"].value)
    rng = np.random.default_rng(seed)

    def f32(*shape: int) -> Tensor:
        w = (rng.standard_normal(shape) * 0.1).astype(np.float32)
        return Tensor("", list(reversed(shape)), 0, w.tobytes())

    def ones(n: int) -> Tensor:  # norms of ones, so activations keep their scale
        return Tensor("", [n], 0, np.ones(n, np.float32).tobytes())

    embd = quantize((rng.standard_normal((vocab, d)) * 0.5).astype(np.float32), GGMLQuantizationType.Q8_0)
    tensors = {"token_embd.weight": Tensor("", [d, vocab], int(GGMLQuantizationType.Q8_0), embd.tobytes())}
    for i in range(2):
        p = f"blk.{i}."
        tensors |= {p + "attn_norm.weight": ones(d), p + "attn_q.weight": f32(heads * head_dim, d),
                    p + "attn_k.weight": f32(kv * head_dim, d), p + "attn_v.weight": f32(kv * head_dim, d),
                    p + "attn_output.weight": f32(d, heads * head_dim), p + "ffn_norm.weight": ones(d),
                    p + "ffn_gate.weight": f32(ffn, d), p + "ffn_up.weight": f32(ffn, d),
                    p + "ffn_down.weight": f32(d, ffn)}  # fmt: skip
    tensors["output_norm.weight"] = ones(d)
    for name, t in tensors.items():
        t.name = name
    src.tensors = list(tensors.values())
    return src


def cut_vocabulary(f: GGUFFields, n: int) -> None:
    """Keep the seed's first n tokens (and the merges among them), with the embedding cut to match: a smaller
    tokenizer builds in milliseconds instead of a second, so a fuzzing campaign runs many more cases."""
    tokens = f.metadata["tokenizer.ggml.tokens"].value[:n]
    kept = set(tokens)
    pairs = [m.split(" ", 1) for m in f.metadata["tokenizer.ggml.merges"].value]
    merges = [" ".join(p) for p in pairs if len(p) == 2 and p[0] in kept and p[1] in kept and "".join(p) in kept]
    f.metadata["tokenizer.ggml.tokens"] = Value(ARRAY, tokens, STRING)
    f.metadata["tokenizer.ggml.merges"] = Value(ARRAY, merges, STRING)
    types = f.metadata["tokenizer.ggml.token_type"]
    f.metadata["tokenizer.ggml.token_type"] = Value(ARRAY, types.value[:n], types.elem_type)
    arch = f.metadata["general.architecture"].value
    f.metadata[f"{arch}.vocab_size"] = Value(UINT32, n)
    embd = next(t for t in f.tensors if t.name == "token_embd.weight")
    row_bytes = len(embd.data) // embd.dims[1]
    embd.dims = [embd.dims[0], n]
    embd.data = embd.data[: n * row_bytes]
