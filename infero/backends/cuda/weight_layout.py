"""The byte order a matrix is stored in on the GPU: GGUF's rows, or for Q4_K and Q6_K the tiled layout.

Tiled: each group of 8 rows stored superblock pair after pair, [rows / 8][superblocks / 2][8][2 slots], a slot one
superblock (Q4_K: its 144 bytes; Q6_K: its 210 and 6 zero bytes), reordered once at load, so that each half of a
decode mat-vec's ring stage (8 rows of one superblock pair) is one contiguous copy instead of 8 pieces a row apart (on
the H200 the 8B's Q4_K gate + up -1.6 to -2.1 us of ~25 a layer, its Q4_K down -1.0 to -1.2 of ~12.7, o -0.45 to
-0.6 of ~6.6: docs/performance.md), and Q6_K's superblocks start on 8-byte boundaries (GGUF's 210-byte ones leave
every other one 2 bytes off a word, realigned word by word). Every kernel that reads the matrix as a linear layer
takes it (the tensor-core mat-vecs, the skinny GEMM, the GEMM: kernels/quant.cuh's tiled_offset); a table whose rows
are gathered by token id (the embedding, and so a head tied to it) keeps the GGUF rows.
"""

from __future__ import annotations

import numpy as np

from infero.backends.cuda import driver, matvec
from infero.backends.cuda.tensor import TILED_SLOT_BYTES, QuantWeight, from_host
from infero.checkpoint.tensor_types import BLOCK_LAYOUTS, GGMLType

GROUP_ROWS = 8


def tiles(ggml_type: int, rows: int, cols: int) -> bool:
    """Whether a linear layer's matrix of this type and shape is stored tiled: Q4_K or Q6_K that the tensor-core
    mat-vec runs (matvec.takes_mma), of whole 16-row tiles and an even count of superblocks a row (a group of 8 rows
    is then 8 tiled rows' bytes)."""
    return (ggml_type in TILED_SLOT_BYTES and rows % 16 == 0 and cols % 512 == 0
            and matvec.takes_mma(ggml_type, cols))  # fmt: skip


def tiled(raw: np.ndarray, ggml_type: int) -> np.ndarray:
    """GGUF rows uint8 [rows, row_bytes] of a Q4_K or Q6_K matrix (rows % 8 == 0, an even count of superblocks a
    row) in the tiled layout: [rows, superblocks x slot bytes]."""
    rows, row_bytes = raw.shape
    block, slot = BLOCK_LAYOUTS[GGMLType(ggml_type)].bytes, TILED_SLOT_BYTES[ggml_type]
    superblocks = row_bytes // block
    if rows % GROUP_ROWS or row_bytes % block or superblocks % 2:
        raise ValueError(f"tiled: [{rows}, {row_bytes}] is not whole groups of 8 rows and superblock pairs")
    groups, pairs = rows // GROUP_ROWS, superblocks // 2
    out = np.empty((groups, pairs, GROUP_ROWS, 2, slot), np.uint8)
    out[..., block:] = 0
    out[..., :block] = raw.reshape(groups, GROUP_ROWS, pairs, 2, block).transpose(0, 2, 1, 3, 4)
    return out.reshape(rows, superblocks * slot)


def upload(raw: np.ndarray, ggml_type: int, rows: int, cols: int, arena: driver.Arena | None = None,
           gathered: bool = False) -> QuantWeight:  # fmt: skip
    """A matrix's GGUF bytes (uint8, rows x row_bytes) onto the GPU, tiled where tiles() says so and its rows are
    not gathered (an embedding table)."""
    data = raw.reshape(rows, -1)
    layout = not gathered and tiles(ggml_type, rows, cols)
    return QuantWeight(from_host(tiled(data, ggml_type) if layout else data, arena), ggml_type, rows, cols, layout)
