"""The skinny tensor-core GEMM (3-64 tokens; Q4_K, Q6_K, Q8_0) against float64 numpy on gguf's dequantization.

Bound: as the GEMM's (test_gemm.py): x rounded to fp16, each weight formed in fp16 from its scale and min (each
rounded once to fp16), products summed in fp32: norm-relative error ~u = 4.9e-4; 2e-3 leaves headroom while a wrong
nibble, scale, column order or split gives errors of order 1. Shapes cover both epilogues: 1000 x 4096 splits k
over blocks (few row tiles), 40000 x 256 does not (more row tiles than SMs); 1000 rows is no multiple of a block's
rows, and the token counts leave partial 8-token tiles.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from test_gemm import describe, weight_case

pytestmark = pytest.mark.gpu

TOLERANCE = 2e-3
TYPES = (Q.Q4_K, Q.Q6_K, Q.Q8_0)
SHAPES = ((1000, 4096), (40000, 256), (300, 14336))
# Q8_0 runs 128-column superblocks: 896 columns (qwen2.5-0.5b's width) is 7 of them, 4864 is 38.
Q8_SHAPES = ((896, 896), (4864, 896), (200, 4864))
TOKEN_COUNTS = (1, 5, 8, 17, 33, 64)


def run_skinny(weight, x: np.ndarray, bias: np.ndarray | None, gemv: bool = False) -> np.ndarray:
    from infero.backends.cuda import driver, runtime, skinny_gemm
    from infero.backends.cuda.tensor import Workspace, empty, from_host

    stream = runtime.stream()
    n, cols = x.shape
    out = empty((n, weight.rows), np.float32)
    driver.memset_d8(out.ptr, 0xFF, out.nbytes, stream)  # NaN everywhere: an unwritten element shows
    xa = empty(skinny_gemm.activation_shape(n, cols), np.uint32)
    ws = Workspace(skinny_gemm.MAX_SPLITS * n * weight.rows * 4 + (1 << 20))
    xd = from_host(x.astype(np.float32))
    bd = from_host(bias.astype(np.float32)) if bias is not None else None
    skinny_gemm.convert(xa, xd, weight.ggml_type, stream)
    (skinny_gemm.skinny_gemv if gemv else skinny_gemm.skinny_gemm)(out, weight, xa, bd, stream, ws)
    assert ws.offset == 0, "skinny_gemm must hand its scratch back"
    stream.synchronize()
    return out.to_host()


CASES = [(t, s) for t in TYPES for s in SHAPES] + [(Q.Q8_0, s) for s in Q8_SHAPES]


@pytest.mark.parametrize("qtype, shape", CASES, ids=[f"{t.name}-{r}x{c}" for t, (r, c) in CASES])
def test_skinny_gemm_matches_float64_reference(gpu, qtype, shape):
    from infero.backends.cuda import runtime, skinny_gemm

    rows, cols = shape
    weight, w = weight_case(qtype, rows, cols)
    rng = np.random.default_rng(cols + 1)
    splits = skinny_gemm.splits(int(qtype), rows, cols, runtime.context().info.num_sms)
    lines, failed = [], False
    for n in TOKEN_COUNTS:
        x = rng.normal(0, 1, size=(n, cols)).astype(np.float32)
        bias = rng.normal(0, 0.5, size=rows).astype(np.float32) if n in (5, 33) else None
        ref = x.astype(np.float64) @ w.T + (bias if bias is not None else 0.0)
        err, text = describe(run_skinny(weight, x, bias), ref)
        bad = not err < TOLERANCE
        failed |= bad
        lines.append(f"{'FAIL' if bad else 'ok  '} {qtype.name} {rows}x{cols} splits={splits} n={n:<3d} "
                     f"bias={'yes' if bias is not None else 'no '} {text}")  # fmt: skip
    print("\n".join(lines))
    assert not failed, "skinny_gemm disagrees with the float64 reference:\n" + "\n".join(lines)


@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
def test_skinny_gemm_row_does_not_depend_on_batch(gpu, qtype):
    """A token's outputs are bitwise the same alone, among 17 and among 64, at any position."""
    weight, _ = weight_case(qtype, 1000, 4096)
    rng = np.random.default_rng(2)
    x = rng.normal(0, 1, size=(64, 4096)).astype(np.float32)
    bias = rng.normal(0, 0.5, size=1000).astype(np.float32)
    full = run_skinny(weight, x, bias)
    picks = np.array([63, 0, 1, 7, 8, 9, 15, 16, 17, 31, 32, 33, 40, 47, 48, 55, 62])
    lines = []
    for subset in (picks, picks[:5], picks[3:4]):
        part = run_skinny(weight, x[subset], bias)
        same = np.all(full[subset].view(np.uint32) == part.view(np.uint32), axis=1)
        if not same.all():
            lines.append(f"n={len(subset)}: tokens {subset[~same].tolist()} differ from the 64-token call")
    assert not lines, "\n".join(lines)


GEMV_CASES = [(t, s, False) for t in TYPES for s in SHAPES] + [(Q.Q8_0, s, False) for s in Q8_SHAPES]
GEMV_CASES += [(Q.Q4_K, (1024, 4096), True), (Q.Q6_K, (1024, 4096), True), (Q.Q4_K, (4096, 14336), True)]


@pytest.mark.parametrize("qtype, shape, tiled", GEMV_CASES,
                         ids=[f"{t.name}-{r}x{c}{'-tiled' if ti else ''}" for t, (r, c), ti in GEMV_CASES])  # fmt: skip
def test_skinny_gemv_gives_skinny_gemms_bits(gpu, qtype, shape, tiled):
    """skinny_gemv is skinny_gemm's numbers, streamed: every output bitwise, at 1-8 tokens, with and without bias,
    whether a row's splits are summed in its block or (Q6_K past 8 splits: 300 x 14336) through skinny_reduce."""
    from infero.backends.cuda import runtime, skinny_gemm, weight_layout

    rows, cols = shape
    weight, _ = weight_case(qtype, rows, cols)
    if tiled:
        assert weight_layout.tiles(int(qtype), rows, cols), "the case must be a shape the tiled layout holds"
        weight = weight_layout.upload(weight.data.to_host(), int(qtype), rows, cols)
    splits = skinny_gemm.splits(int(qtype), rows, cols, runtime.context().info.num_sms)
    rng = np.random.default_rng(rows + cols)
    lines = []
    for n in (1, 2, 3, 8):
        x = rng.normal(0, 1, size=(n, cols)).astype(np.float32)
        bias = rng.normal(0, 0.5, size=rows).astype(np.float32) if n in (1, 3) else None
        want, got = run_skinny(weight, x, bias), run_skinny(weight, x, bias, gemv=True)
        differ = int((want.view(np.uint32) != got.view(np.uint32)).sum())
        if differ:
            lines.append(f"{qtype.name} {rows}x{cols} splits={splits} n={n} bias={bias is not None}: {differ} of "
                         f"{want.size} outputs differ (largest {np.nanmax(np.abs(want - got)):.3e})")  # fmt: skip
    assert not lines, "\n".join(lines)


@pytest.mark.parametrize("qtype, shape", [(Q.Q4_K, (1000, 4096)), (Q.Q6_K, (300, 14336)), (Q.Q8_0, (896, 896))],
                         ids=lambda v: getattr(v, "name", None) or "x".join(map(str, v)))  # fmt: skip
def test_skinny_gemv_runs_several_matrices_each_as_alone(gpu, qtype, shape):
    """q/k/v or gate and up in one skinny_gemv launch (skinny_gemv_many: segments of different rows, so of
    different splits and block shapes, with and without bias): each output bitwise its matrix's own skinny_gemm
    (Q6_K 300 x 14336: through skinny_reduce)."""
    from infero.backends.cuda import runtime, skinny_gemm
    from infero.backends.cuda.tensor import Workspace, empty, from_host

    rows, cols = shape
    weights = [weight_case(qtype, rows, cols)[0], _other_weight(qtype, rows, cols), _other_weight(qtype, 64, cols)]
    rng = np.random.default_rng(rows)
    biases = [None, rng.normal(0, 0.5, size=rows).astype(np.float32), None]
    stream, ws = runtime.stream(), Workspace(3 * skinny_gemm.MAX_SPLITS * 8 * rows * 4 + (1 << 20))
    for n in (1, 8):
        x = rng.normal(0, 1, size=(n, cols)).astype(np.float32)
        xa = empty(skinny_gemm.activation_shape(n, cols), np.uint32)
        skinny_gemm.convert(xa, from_host(x), int(qtype), stream)
        for count in (2, 3):
            outs = [empty((n, w.rows), np.float32) for w in weights[:count]]
            bias_d = [from_host(b) if b is not None else None for b in biases[:count]]
            skinny_gemm.skinny_gemv_many(outs, weights[:count], xa, bias_d, stream, ws)
            for out, weight, bias in zip(outs, weights, biases, strict=False):
                want = run_skinny(weight, x, bias).view(np.uint32)
                assert np.array_equal(out.to_host(stream).view(np.uint32), want), f"n={n}, {count} matrices"


def _other_weight(qtype, rows: int, cols: int):
    """Another weight of `rows` rows: weight_case's rows (of at least 1000) in another order."""
    from infero.backends.cuda.tensor import QuantWeight, from_host

    raw = weight_case(qtype, max(rows, 1000), cols)[0].data.to_host()
    other = raw[np.random.default_rng(7).permutation(raw.shape[0])[:rows]]  # the same blocks in another order
    return QuantWeight(from_host(np.ascontiguousarray(other)), int(qtype), rows, cols)


def test_skinny_gemm_rejects_what_it_cannot_run(gpu):
    from infero.backends.cuda import runtime, skinny_gemm
    from infero.backends.cuda.tensor import Workspace, empty

    weight, _ = weight_case(Q.Q4_K, 1000, 4096)
    stream, ws = runtime.stream(), Workspace(1 << 20)
    xa = empty(skinny_gemm.activation_shape(64, 4096), np.uint32)
    with pytest.raises(ValueError, match="65 tokens"):
        skinny_gemm.skinny_gemm(empty((65, 1000), np.float32), weight, xa, None, stream, ws)
    with pytest.raises(ValueError, match="65 tokens"):
        skinny_gemm.activation_shape(65, 4096)
    with pytest.raises(ValueError, match="9 tokens"):
        skinny_gemm.skinny_gemv(empty((9, 1000), np.float32), weight, xa, None, stream, ws)
    q5, _ = weight_case(Q.Q5_0, 200, 1056)
    with pytest.raises(ValueError, match="no kernel for type 6"):
        skinny_gemm.skinny_gemm(empty((8, 200), np.float32), q5, xa, None, stream, ws)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_add_rms_norm_writes_the_skinny_layout_as_convert_does(gpu, qtype):
    """add_rms_norm's skinny output (kernels/skinny_layout.cuh): every real token's slots bitwise what
    skinny_gemm.convert writes from the norm's float output, at 1 / 3 / 8 / 17 / 64 tokens."""
    from infero.backends.cuda import elementwise, runtime, skinny_gemm
    from infero.backends.cuda.tensor import empty, from_host

    stream, dim = runtime.stream(), 1024
    rng = np.random.default_rng(int(qtype))
    weight = from_host(rng.normal(1, 0.1, size=dim).astype(np.float32))
    for n in (1, 3, 8, 17, 64):
        residual = from_host(rng.normal(0, 1, size=(n, dim)).astype(np.float32))
        x = from_host(rng.normal(0, 1, size=(n, dim)).astype(np.float32))
        out = empty((n, dim), np.float32)
        fused = from_host(np.full(skinny_gemm.activation_shape(n, dim), 0x7E007E00, np.uint32))  # NaN halves
        elementwise.add_rms_norm(out, residual, x, weight, 1e-6, stream, None, (fused, int(qtype)))
        want = empty(skinny_gemm.activation_shape(n, dim), np.uint32)
        skinny_gemm.convert(want, out, int(qtype), stream)
        got, ref = fused.to_host(stream), want.to_host(stream)
        tiles = skinny_gemm.tiles(n)
        tokens = (np.arange(got.shape[0]) // 32 % tiles) * 8 + np.arange(got.shape[0]) % 32 // 4  # a slot's token
        real = tokens < n
        assert np.array_equal(got[real], ref[real]), f"n={n}: the norm's layout differs from convert's"


@pytest.mark.parametrize("qtype, down_type", [(Q.Q4_K, Q.Q4_K), (Q.Q4_K, Q.Q6_K), (Q.Q8_0, Q.Q8_0)],
                         ids=["Q4_K", "Q4_K-Q6_K", "Q8_0"])  # fmt: skip
def test_skinny_gemv_glu_is_the_unfused_swiglu_bitwise(gpu, qtype, down_type):
    """skinny_gemv_glu (gate, up and SwiGLU in one launch) against skinny_gemm's gate and up, elementwise.swiglu
    and convert: the float output and every real token's slot of down's fp16 input bitwise, at 1 / 3 / 8 tokens
    (1024 rows: the gate's splits and the up's in one block)."""
    from infero.backends.cuda import elementwise, runtime, skinny_gemm
    from infero.backends.cuda.tensor import empty, from_host

    rows, cols = 1024, 4096 if qtype != Q.Q8_0 else 896
    gate, up = weight_case(qtype, rows, cols)[0], _other_weight(qtype, rows, cols)
    assert skinny_gemm.gemv_glu_fits(gate, up, 8), "the case must be one the fused launch takes"
    stream = runtime.stream()
    for n in (1, 3, 8):
        x = np.random.default_rng(n).normal(0, 1, size=(n, cols)).astype(np.float32)
        xa = empty(skinny_gemm.activation_shape(n, cols), np.uint32)
        skinny_gemm.convert(xa, from_host(x), int(qtype), stream)
        out = empty((n, rows), np.float32)
        down_xa = empty(skinny_gemm.activation_shape(n, rows), np.uint32)
        skinny_gemm.skinny_gemv_glu(out, gate, up, xa, down_xa, int(down_type), stream)
        g, u = from_host(run_skinny(gate, x, None)), from_host(run_skinny(up, x, None))
        ref = empty((n, rows), np.float32)
        elementwise.swiglu(ref, g, u, stream)
        ref_xa = empty(skinny_gemm.activation_shape(n, rows), np.uint32)
        skinny_gemm.convert(ref_xa, ref, int(down_type), stream)
        assert np.array_equal(out.to_host(stream).view(np.uint32), ref.to_host(stream).view(np.uint32)), f"n={n}"
        got, want = down_xa.to_host(stream), ref_xa.to_host(stream)
        slot = np.arange(got.shape[0])
        real = (slot // 32 % skinny_gemm.tiles(n)) * 8 + slot % 32 // 4 < n
        assert np.array_equal(got[real], want[real]), f"n={n}: down's input"
