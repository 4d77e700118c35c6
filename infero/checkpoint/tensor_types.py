"""GGML tensor types: the id stored in a GGUF file, and how many elements and bytes one block holds."""

from dataclasses import dataclass
from enum import IntEnum


class GGMLType(IntEnum):
    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q8_1 = 9
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q8_K = 15
    IQ2_XXS = 16
    IQ2_XS = 17
    IQ3_XXS = 18
    IQ1_S = 19
    IQ4_NL = 20
    IQ3_S = 21
    IQ2_S = 22
    IQ4_XS = 23
    I8 = 24
    I16 = 25
    I32 = 26
    I64 = 27
    F64 = 28
    IQ1_M = 29
    BF16 = 30
    TQ1_0 = 34
    TQ2_0 = 35
    MXFP4 = 39


@dataclass(frozen=True)
class BlockLayout:
    elements: int
    bytes: int


# (elements per block, bytes per block) as ggml defines them; every type a GGUF file may hold is listed
# so a file with a type we do not run still parses and inspects, and fails only when a model needs it.
BLOCK_LAYOUTS: dict[GGMLType, BlockLayout] = {
    GGMLType.F32: BlockLayout(1, 4),
    GGMLType.F16: BlockLayout(1, 2),
    GGMLType.BF16: BlockLayout(1, 2),
    GGMLType.F64: BlockLayout(1, 8),
    GGMLType.I8: BlockLayout(1, 1),
    GGMLType.I16: BlockLayout(1, 2),
    GGMLType.I32: BlockLayout(1, 4),
    GGMLType.I64: BlockLayout(1, 8),
    GGMLType.Q4_0: BlockLayout(32, 18),
    GGMLType.Q4_1: BlockLayout(32, 20),
    GGMLType.Q5_0: BlockLayout(32, 22),
    GGMLType.Q5_1: BlockLayout(32, 24),
    GGMLType.Q8_0: BlockLayout(32, 34),
    GGMLType.Q8_1: BlockLayout(32, 36),
    GGMLType.Q2_K: BlockLayout(256, 84),
    GGMLType.Q3_K: BlockLayout(256, 110),
    GGMLType.Q4_K: BlockLayout(256, 144),
    GGMLType.Q5_K: BlockLayout(256, 176),
    GGMLType.Q6_K: BlockLayout(256, 210),
    GGMLType.Q8_K: BlockLayout(256, 292),
    GGMLType.IQ2_XXS: BlockLayout(256, 66),
    GGMLType.IQ2_XS: BlockLayout(256, 74),
    GGMLType.IQ3_XXS: BlockLayout(256, 98),
    GGMLType.IQ1_S: BlockLayout(256, 50),
    GGMLType.IQ4_NL: BlockLayout(32, 18),
    GGMLType.IQ3_S: BlockLayout(256, 110),
    GGMLType.IQ2_S: BlockLayout(256, 82),
    GGMLType.IQ4_XS: BlockLayout(256, 136),
    GGMLType.IQ1_M: BlockLayout(256, 56),
    GGMLType.TQ1_0: BlockLayout(256, 54),
    GGMLType.TQ2_0: BlockLayout(256, 66),
    GGMLType.MXFP4: BlockLayout(32, 17),
}

# The types infero runs (issue scope); others parse and inspect but refuse to load into a model.
SUPPORTED_TYPES = frozenset(
    {
        GGMLType.F32, GGMLType.F16, GGMLType.BF16,
        GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1,
        GGMLType.Q2_K, GGMLType.Q3_K, GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K,
        GGMLType.IQ4_NL, GGMLType.IQ4_XS,
    }
)  # fmt: skip


def type_name(type_id: int) -> str:
    try:
        return GGMLType(type_id).name
    except ValueError:
        return f"unknown type {type_id}"
