"""The tensor-core GEMM against float64 numpy on gguf's own dequantization, for every weight type we run.

Bound: both operands are rounded to fp16 (unit roundoff u = 2^-11 ~ 4.9e-4) and accumulated in fp32. Each
product carries at most ~2u of relative error, independent from term to term, so over k terms the error grows
like the result itself (sqrt(k)) and the norm-relative error stays below u (2-3.5e-4 measured on the H200); fp32
accumulation adds ~sqrt(k) * 2^-24, negligible. 2e-3 leaves ~6x headroom, while a wrong nibble, scale or block
offset gives errors of order 1.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize
from tiny_gguf import ALL_TYPES, encode_weight

pytestmark = pytest.mark.gpu

TOLERANCE = 2e-3
TOKEN_COUNTS = (17, 64, 100, 512)
SMALL_BLOCK_TYPES = [t for t in ALL_TYPES if t not in (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS)]
# (rows, cols): 1000 and 200 rows are not multiples of the 32- or 128-row tiles; 896 columns is not a multiple of
# 256 (the K-quant block); 1056 = 16.5 slices of 64, so the last k slice is half zeros. Token counts 17 and 100
# leave partial token tiles.
SHAPES = [(1000, 4096)]
SMALL_BLOCK_SHAPES = [(896, 896), (200, 1056)]
CASES = [(t, s) for t in ALL_TYPES for s in SHAPES] + [(t, s) for t in SMALL_BLOCK_TYPES for s in SMALL_BLOCK_SHAPES]


@functools.cache
def weight_case(qtype: Q, rows: int, cols: int):
    """(QuantWeight on the GPU, float64 dequantized [rows, cols]) for random valid blocks of qtype."""
    from infero.backends.cuda.tensor import QuantWeight, from_host

    rng = np.random.default_rng(rows * 7919 + cols * 31 + int(qtype))
    data, _ = encode_weight(rng.normal(0, 0.05, size=(rows, cols)).astype(np.float32), qtype, rng)
    raw = np.ascontiguousarray(data).view(np.uint8).reshape(rows, -1)
    w = np.asarray(dequantize(raw, qtype), np.float64).reshape(rows, cols)
    assert np.isfinite(w).all()
    return QuantWeight(from_host(raw), int(qtype), rows, cols), w


def fitting_tiles(qtype: int) -> list[tuple[int, int]]:
    """The block tiles whose shared memory this GPU holds (all of them on an H100/H200)."""
    from infero.backends.cuda import gemm, runtime

    limit = runtime.context().info.max_shared_per_block_optin
    return [t for t in gemm.TILES if gemm.shared_bytes(qtype, t) <= limit]


def run_gemm(weight, x: np.ndarray, bias: np.ndarray | None, tile: tuple[int, int]) -> np.ndarray:
    from infero.backends.cuda import driver, gemm, runtime
    from infero.backends.cuda.tensor import Workspace, empty, from_host

    stream = runtime.stream()
    n = x.shape[0]
    out = empty((n, weight.rows), np.float32)
    driver.memset_d8(out.ptr, 0xFF, out.nbytes, stream)  # NaN everywhere: an unwritten element shows
    ws = Workspace(n * (weight.cols + 64) * 2 + (1 << 20))
    xd = from_host(x.astype(np.float32))
    bd = from_host(bias.astype(np.float32)) if bias is not None else None
    gemm.gemm(out, weight, xd, bd, stream, ws, tile=tile)
    assert ws.offset == 0, "gemm must hand its scratch back"
    stream.synchronize()
    return out.to_host()


def rel_err(out: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(out.astype(np.float64) - ref) / max(np.linalg.norm(ref), 1e-30))


def describe(out: np.ndarray, ref: np.ndarray) -> tuple[float, str]:
    nans = int(np.isnan(out).sum())
    err = rel_err(out, ref) if nans == 0 else float("inf")
    diff = np.abs(np.nan_to_num(out, nan=np.inf).astype(np.float64) - ref)
    worst = np.unravel_index(int(np.argmax(diff)), diff.shape)
    text = (f"rel_err {err:.2e}  max_abs_err {diff.max():.3e} at (token {worst[0]}, row {worst[1]})  "
            f"max|ref| {np.abs(ref).max():.3e}  NaN {nans}")  # fmt: skip
    return err, text


@pytest.mark.parametrize("qtype, shape", CASES, ids=[f"{t.name}-{r}x{c}" for t, (r, c) in CASES])
def test_gemm_matches_float64_reference(gpu, qtype, shape):
    rows, cols = shape
    weight, w = weight_case(qtype, rows, cols)
    rng = np.random.default_rng(cols)
    lines, failed = [], False
    for n in TOKEN_COUNTS:
        x = rng.normal(0, 1, size=(n, cols)).astype(np.float32)
        bias = rng.normal(0, 0.5, size=rows).astype(np.float32) if n in (17, 100) else None
        with_bias = "yes" if bias is not None else "no "
        ref = x.astype(np.float64) @ w.T + (bias if bias is not None else 0.0)
        for tile in fitting_tiles(int(qtype)):
            err, text = describe(run_gemm(weight, x, bias, tile), ref)
            bad = not err < TOLERANCE
            failed |= bad
            lines.append(f"{'FAIL' if bad else 'ok  '} {qtype.name:7s} {rows}x{cols} n={n:<4d} "
                         f"tile={tile[0]}x{tile[1]:<3d} bias={with_bias} {text}")  # fmt: skip
    print("\n".join(lines))
    assert not failed, "gemm disagrees with the float64 reference:\n" + "\n".join(lines)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=[t.name for t in ALL_TYPES])
def test_gemm_row_does_not_depend_on_batch(gpu, qtype):
    """Row i of a 512-token call is bitwise row i of a 17-token call holding the same token, for every tile."""
    weight, _ = weight_case(qtype, 1000, 4096)
    rng = np.random.default_rng(1)
    x = rng.normal(0, 1, size=(512, 4096)).astype(np.float32)
    bias = rng.normal(0, 0.5, size=1000).astype(np.float32)
    picks = np.array([0, 1, 63, 64, 65, 127, 128, 200, 255, 256, 300, 383, 384, 450, 500, 510, 511])
    tiles = fitting_tiles(int(qtype))
    part = run_gemm(weight, x[picks], bias, tiles[0])
    lines = []
    for tile in tiles:
        out = run_gemm(weight, x, bias, tile)
        same = np.all(out[picks].view(np.uint32) == part.view(np.uint32), axis=1)
        if not same.all():
            diff = np.abs(out[picks][~same].astype(np.float64) - part[~same]).max()
            lines.append(f"{qtype.name}: n=512 tile {tile} vs n=17 tile {tiles[0]} differ on tokens "
                         f"{picks[~same].tolist()} (max {diff:.3e})")  # fmt: skip
    assert not lines, "\n".join(lines)
