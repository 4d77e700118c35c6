"""Q4_K and Q6_K matrices stored tiled (weight_layout.py): the layout itself, and every kernel that reads a linear
layer's weights giving bitwise the outputs it gives from the GGUF rows (whose kernels test_matvec.py, test_gemm.py and
test_skinny_gemm.py check against gguf's dequantizer), at every token count each one takes."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from test_matvec import deferred_activation, weight_case

Q4_K, Q6_K = int(Q.Q4_K), int(Q.Q6_K)


@pytest.mark.parametrize("qtype, block, slot", [(Q.Q4_K, 144, 144), (Q.Q6_K, 210, 216)])
def test_tiled_layout_puts_each_superblock_where_the_layout_says(qtype, block, slot):
    """Superblock sb of row r at ((r // 8 * pairs + sb // 2) * 8 + r % 8) * 2 slot + sb % 2 * slot, followed by zeros
    up to the slot: [rows / 8][pairs][8][2 slots], written out from the layout's definition, not from the reshape that
    builds it."""
    from infero.backends.cuda.weight_layout import tiled

    rows, nsb = 24, 6
    raw = np.random.default_rng(0).integers(0, 256, size=(rows, block * nsb), dtype=np.uint8)
    flat = tiled(raw, int(qtype)).reshape(-1)
    assert flat.size == rows * nsb * slot
    pairs = nsb // 2
    for r in range(rows):
        for sb in range(nsb):
            at = ((r // 8 * pairs + sb // 2) * 8 + r % 8) * 2 * slot + sb % 2 * slot
            assert np.array_equal(flat[at : at + block], raw[r, block * sb : block * (sb + 1)]), (r, sb)
            assert not flat[at + block : at + slot].any(), (r, sb)
    with pytest.raises(ValueError, match="whole groups"):
        tiled(raw[:20], int(qtype))
    with pytest.raises(ValueError, match="whole groups"):
        tiled(raw[:, : block * 5], int(qtype))


def both_layouts(rows: int, cols: int, seed: int = 0, qtype: Q = Q.Q4_K):
    """(GGUF rows, tiled) of the same random matrix."""
    from infero.backends.cuda import runtime, weight_layout

    rows_weight = weight_case(qtype, rows, cols, seed)[0]
    raw = rows_weight.data.to_host(runtime.stream())
    tiled = weight_layout.upload(raw, int(qtype), rows, cols)
    assert tiled.tiled, f"{qtype.name} {rows}x{cols} should be stored tiled"
    return rows_weight, tiled


def assert_same_bits(label: str, got: np.ndarray, want: np.ndarray) -> None:
    bits = {4: np.uint32, 2: np.uint16, 1: np.uint8}[got.dtype.itemsize]
    differ = np.argwhere(got.view(bits) != want.view(bits))
    assert not len(differ), f"{label}: {len(differ)} elements differ from the GGUF rows', first at {differ[0]}"


MATVEC_CASES = [(Q.Q4_K, 96, 1024), (Q.Q4_K, 1024, 4096), (Q.Q4_K, 32, 14336), (Q.Q6_K, 96, 2048),
                (Q.Q6_K, 1024, 4096), (Q.Q6_K, 32, 14336)]  # fmt: skip


@pytest.mark.parametrize("qtype, rows, cols", MATVEC_CASES, ids=[f"{t.name}-{r}x{c}" for t, r, c in MATVEC_CASES])
def test_matvec_reads_the_tiled_layout(gpu, qtype, rows, cols):
    from test_matvec import run_matvec

    rows_weight, tiled = both_layouts(rows, cols, qtype=qtype)
    x = np.random.default_rng(rows + cols).normal(0, 1, size=(16, cols)).astype(np.float32)
    for n in (1, 2, 3, 8, 16):
        want = run_matvec(rows_weight, x[:n], None)
        assert np.isfinite(want).all()
        assert_same_bits(f"matvec {qtype.name} {rows}x{cols} n={n}", run_matvec(tiled, x[:n], None), want)


@pytest.mark.parametrize("deferred", [False, True])
@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K], ids=lambda q: q.name)
def test_rope_glu_and_norm_launches_read_the_tiled_layout(gpu, qtype, n, deferred):
    """A decode step's fused launches: q/k/v with rotary and the K/V write (Q4_K q and k with Q6_K v: one mixed
    launch; or all Q6_K), gate + up + SwiGLU, and a projection with the residual add and the next norm."""
    from test_matvec import deferred_buffers

    from infero.backends.cuda import driver, matvec, runtime
    from infero.backends.cuda.tensor import Workspace, empty, from_host

    stream, rng = runtime.stream(), np.random.default_rng(n + 10 * deferred)
    cols, heads, kv_heads, head_dim = 4096, 4, 2, 128

    def fresh(shape, dtype):
        t = empty(shape, dtype)
        driver.memset_d8(t.ptr, 0xFF, t.nbytes, stream)
        return t

    def results(*tensors) -> list[np.ndarray]:
        stream.synchronize()
        return [t.to_host() for t in tensors]

    x_host = rng.normal(0, 1, size=(n, cols)).astype(np.float32)
    x = from_host(x_host)
    quantized = deferred_activation(x_host, rng.uniform(0.5, 2, size=cols).astype(np.float32), 1e-5)[0]
    if not deferred:
        quantized = (fresh(quantized.q.shape, np.int8), fresh(quantized.s.shape, np.int32))
        matvec.quantize(*quantized, x, stream)
    ws = Workspace(1 << 20)

    # q/k/v
    q_pair, k_pair = (both_layouts(r, cols, i, qtype) for i, r in ((1, heads * head_dim), (2, kv_heads * head_dim)))
    v_pair = both_layouts(kv_heads * head_dim, cols, 3, Q.Q6_K)
    positions, slots = from_host(np.array([700, 9][:n], np.int32)), from_host(np.array([21, 3][:n], np.int64))
    inv_freq = from_host((5e5 ** (-np.arange(0, head_dim, 2) / head_dim)).astype(np.float32))
    outputs = []
    for layout in (0, 1):
        outs = [fresh((n, r), np.float32) for r in (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim)]
        k_cache, v_cache = (fresh((4, 16, kv_heads, head_dim), np.float16) for _ in range(2))
        weights = [q_pair[layout], k_pair[layout], v_pair[layout]]
        groups = [[0, 1, 2]] if qtype == Q.Q6_K or matvec.mixes((Q4_K, Q4_K, Q6_K), cols) else [[0, 1], [2]]
        for group in groups:
            matvec.matvec_rope([outs[i] for i in group], [weights[i] for i in group], tuple("qkv"[i] for i in group),
                               x, None, positions, inv_freq, 1.0, "interleaved", head_dim, k_cache, v_cache, slots,
                               stream, ws, quantized)  # fmt: skip
        outputs.append(results(*outs, k_cache, v_cache))
    for name, got, want in zip(("q", "k", "v", "k cache", "v cache"), outputs[1], outputs[0], strict=True):
        assert_same_bits(f"{qtype.name} q/k/v {name} n={n}", got, want)

    # gate + up + SwiGLU
    rows = 1024
    gates, ups = both_layouts(rows, cols, 4, qtype), both_layouts(rows, cols, 5, qtype)
    outputs = []
    for layout in (0, 1):
        assert matvec.glu_fits(gates[layout], ups[layout], n)
        out = fresh((n, rows), np.float32)
        yq, ys = fresh(matvec.activation_shapes(n, rows)[0], np.int8), fresh(matvec.activation_shapes(n, rows)[1],
                                                                              np.int32)  # fmt: skip
        matvec.matvec_glu(out, gates[layout], ups[layout], x, (None, None), quantized, (yq, ys), stream)
        outputs.append(results(out, yq, ys))
    for name, got, want in zip(("out", "q", "s"), outputs[1], outputs[0], strict=True):
        assert_same_bits(f"{qtype.name} gate + up {name} n={n}", got, want)

    # o / down with the residual add and the norm (its input cannot carry a deferred norm)
    if deferred:
        return
    projections = both_layouts(rows, cols, 6, qtype)
    residual0 = rng.normal(0, 3, size=(n, rows)).astype(np.float32)
    norm_weight = from_host(rng.uniform(0.5, 2, size=rows).astype(np.float32))
    outputs = []
    for layout in (0, 1):
        residual = from_host(residual0)
        y = matvec.Activation(*deferred_buffers(n, rows), 1e-5)
        matvec.matvec_norm(residual, projections[layout], x, quantized, norm_weight, y, stream)
        outputs.append(results(residual, y.q, y.s, y.norm_ss))
    for name, got, want in zip(("residual", "q", "s", "norm_ss"), outputs[1], outputs[0], strict=True):
        assert_same_bits(f"{qtype.name} norm {name} n={n}", got, want)


@pytest.mark.parametrize("n", [3, 8, 40, 64])
@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K], ids=lambda q: q.name)
def test_skinny_gemm_reads_the_tiled_layout(gpu, qtype, n):
    from test_skinny_gemm import run_skinny

    rows_weight, tiled = both_layouts(512, 2048, 7, qtype)
    x = np.random.default_rng(n).normal(0, 1, size=(n, 2048)).astype(np.float32)
    want = run_skinny(rows_weight, x, None)
    assert np.isfinite(want).all()
    assert_same_bits(f"{qtype.name} skinny gemm n={n}", run_skinny(tiled, x, None), want)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K], ids=lambda q: q.name)
def test_gemm_reads_the_tiled_layout_with_every_tile(gpu, qtype):
    from test_gemm import fitting_tiles, run_gemm

    rows_weight, tiled = both_layouts(272, 2048, 8, qtype)
    x = np.random.default_rng(9).normal(0, 1, size=(150, 2048)).astype(np.float32)
    for tile in fitting_tiles(int(qtype)):
        want = run_gemm(rows_weight, x, None, tile)
        assert np.isfinite(want).all()
        assert_same_bits(f"{qtype.name} gemm tile {tile}", run_gemm(tiled, x, None, tile), want)


def test_only_whole_tiles_and_pairs_of_linear_layers_are_tiled_and_other_readers_refuse_them(gpu):
    from infero.backends.cuda import embedding, matvec, weight_layout
    from infero.backends.cuda.tensor import empty, from_host

    assert weight_layout.tiles(Q4_K, 4096, 4096) and weight_layout.tiles(Q4_K, 14336, 4096)
    assert not weight_layout.tiles(Q4_K, 40, 1024)  # a tile cut short
    assert not weight_layout.tiles(Q4_K, 64, 768)  # three superblocks a row
    assert weight_layout.tiles(Q6_K, 4096, 14336) and weight_layout.tiles(Q6_K, 128256, 4096)
    assert not weight_layout.tiles(Q6_K, 1024, 1024)  # Q6_K rows the tensor-core mat-vec does not take
    assert not weight_layout.tiles(int(Q.Q8_0), 1024, 4096)
    rows_weight, tiled = both_layouts(64, 1024, 10)
    raw = rows_weight.data.to_host()
    assert not weight_layout.upload(raw, Q4_K, 64, 1024, gathered=True).tiled  # an embedding table
    out = empty((2, 1024), np.float32)
    with pytest.raises(ValueError, match="tiled layout"):
        embedding.embedding(out, tiled, from_host(np.array([1, 2], np.int32)), None)
    assert matvec.glu_fits(rows_weight, rows_weight, 1) and not matvec.glu_fits(rows_weight, tiled, 1)
