"""The byte order a matrix is stored in on the GPU: GGUF's rows, or for Q4_K the tiled layout.

Tiled: each group of 8 rows stored pair of superblocks after pair, [rows / 8][superblocks / 2][8][288 bytes]: the
same bytes as the GGUF rows, reordered once at load, so that each half of a decode mat-vec's ring stage (8 rows of
one superblock pair) is one contiguous 2,304-byte copy instead of 8 pieces of 288 bytes a row apart (on the H200 the
8B's gate + up -1.6 to -2.1 us of ~25 a layer, its Q4_K down -1.0 to -1.2 of ~12.7, o -0.45 to -0.6 of ~6.6;
docs/performance.md). Every kernel that reads the matrix as a linear layer takes it (the tensor-core mat-vecs, the
skinny GEMM, the GEMM: kernels/quant.cuh's tiled_q4k_offset); a table whose rows are gathered by token id (the
embedding, and so a head tied to it) keeps the GGUF rows.
"""

from __future__ import annotations

import numpy as np

from infero.backends.cuda import driver, matvec
from infero.backends.cuda.tensor import QuantWeight, from_host
from infero.checkpoint.tensor_types import GGMLType

Q4_K = int(GGMLType.Q4_K)
GROUP_ROWS = 8
PAIR_BYTES = 288  # two Q4_K superblocks


def tiles(ggml_type: int, rows: int, cols: int) -> bool:
    """Whether a linear layer's matrix of this type and shape is stored tiled: Q4_K that the tensor-core mat-vec
    runs (matvec.takes_mma), of whole 16-row tiles and an even count of superblocks a row (no padding: the tiled
    matrix has the GGUF one's size, a group of 8 rows its 8 rows' bytes)."""
    return ggml_type == Q4_K and rows % 16 == 0 and cols % 512 == 0 and matvec.takes_mma(ggml_type, cols)


def tiled_q4k(raw: np.ndarray) -> np.ndarray:
    """Q4_K rows uint8 [rows, row_bytes] in the tiled layout (rows % 8 == 0, row_bytes % 288 == 0), same shape."""
    rows, row_bytes = raw.shape
    if rows % GROUP_ROWS or row_bytes % PAIR_BYTES:
        raise ValueError(f"tiled_q4k: [{rows}, {row_bytes}] is not whole groups of 8 rows and superblock pairs")
    groups, pairs = rows // GROUP_ROWS, row_bytes // PAIR_BYTES
    grouped = raw.reshape(groups, GROUP_ROWS, pairs, PAIR_BYTES).transpose(0, 2, 1, 3)
    return np.ascontiguousarray(grouped).reshape(rows, row_bytes)


def upload(raw: np.ndarray, ggml_type: int, rows: int, cols: int, arena: driver.Arena | None = None,
           gathered: bool = False) -> QuantWeight:  # fmt: skip
    """A matrix's GGUF bytes (uint8, rows x row_bytes) onto the GPU, tiled where tiles() says so and its rows are
    not gathered (an embedding table)."""
    data = raw.reshape(rows, -1)
    tiled = not gathered and tiles(ggml_type, rows, cols)
    return QuantWeight(from_host(tiled_q4k(data) if tiled else data, arena), ggml_type, rows, cols, tiled)
