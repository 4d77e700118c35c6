"""linear_mma, the int8 tensor-core linear layer for more than 16 tokens (Q4_K-Q6_K, Q8_0, Q4_0-Q5_1, IQ4_NL, IQ4_XS).

1. Bitwise the mat-vec: every row of an n-token launch is the bits the mat-vec (matvec_q, or matvec_mma where it
   takes a tiled Q4_K / Q6_K matrix) gives the same token in 16-token slices: both follow the linear-layer
   definition (unit_value.cuh: per-unit values, span trees, spans in fixed point), whatever the tiles or splits of
   either kernel.
   The two kernels are compared with each other, never with bits recorded from one of them.
2. Against float64 numpy: x as the kernel sees it (quantize_like_kernel's two planes) times gguf's dequantized
   weights; only fp32 rounding of the unit values and span trees and one rounding of the sum remain (bound 1e-5, as the
   mat-vec's).
3. A deferred norm's factor: with norm_ss given, every output is the plain output times 1 / rms (formed as the
   mat-vec forms it, emulated in float32 here), then + bias.
Shapes: 1000 rows end inside a block's row tile and split k over blocks (few row tiles); 14336 x 4096 takes one
split; Q4_K / Q6_K of 1024 x 4096 are stored tiled (weight_layout.tiles); Q8_0 rows of 896 and 576 columns end
inside a span. Outputs are poisoned with NaN first.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize
from test_gemm import describe
from test_matvec import quantize_like_kernel
from tiny_gguf import encode_weight

TIGHT = 1e-5
TOKEN_COUNTS = (17, 33, 64, 200, 512)
# (type, rows, cols, stored tiled)
CASES = [
    (Q.Q4_K, 1000, 4096, False),
    (Q.Q4_K, 1024, 4096, True),
    (Q.Q5_K, 1000, 4096, False),
    (Q.Q6_K, 1000, 2048, False),
    (Q.Q6_K, 1024, 4096, True),
    (Q.Q8_0, 1000, 4096, False),
    (Q.Q4_K, 14336, 512, True),
    (Q.Q8_0, 4096, 768, False),
    (Q.Q8_0, 1000, 896, False),  # qwen2.5-0.5b's hidden size: a last span of 4 units
    (Q.Q8_0, 600, 576, False),  # SmolLM2's: a last span of 2 units
    (Q.Q4_0, 1000, 2048, False),
    (Q.Q4_1, 1000, 4096, False),
    (Q.Q5_0, 1000, 2048, False),
    (Q.Q5_1, 1000, 2048, False),
    (Q.IQ4_NL, 1000, 2048, False),
    (Q.IQ4_XS, 1000, 2048, False),
]


def make_weight(qtype: Q, rows: int, cols: int, tiled: bool):
    """(QuantWeight on the GPU in the asked layout, float64 dequantized [rows, cols])."""
    from infero.backends.cuda import weight_layout
    from infero.backends.cuda.tensor import QuantWeight, from_host

    rng = np.random.default_rng(rows * 7919 + cols * 31 + int(qtype))
    data, _ = encode_weight(rng.normal(0, 0.05, size=(rows, cols)).astype(np.float32), qtype, rng)
    raw = np.ascontiguousarray(data).view(np.uint8).reshape(rows, -1)
    w = np.asarray(dequantize(raw, qtype), np.float64).reshape(rows, cols)
    if tiled:
        assert weight_layout.tiles(int(qtype), rows, cols), "the case must be a shape the tiled layout holds"
        weight = weight_layout.upload(raw, int(qtype), rows, cols)
        assert weight.tiled
    else:
        weight = QuantWeight(from_host(raw), int(qtype), rows, cols)
    return weight, w


def _activation(x: np.ndarray, norm_ss: np.ndarray | None = None, eps: float = 0.0):
    """x quantized by matvec.quantize on the GPU (and with norm_ss a deferred norm's Activation)."""
    from infero.backends.cuda import matvec, runtime
    from infero.backends.cuda.tensor import empty, from_host

    n, cols = x.shape
    q_shape, s_shape = matvec.activation_shapes(n, cols)
    xq, xs = empty(q_shape, np.int8), empty(s_shape, np.int32)
    matvec.quantize(xq, xs, from_host(np.ascontiguousarray(x, np.float32)), runtime.stream())
    if norm_ss is None:
        return xq, xs
    return matvec.Activation(xq, xs, from_host(norm_ss.astype(np.float32)), eps)


def run_linear_mma(weight, x: np.ndarray, bias: np.ndarray | None, norm_ss=None, eps: float = 0.0) -> np.ndarray:
    from infero.backends.cuda import driver, linear_mma, runtime
    from infero.backends.cuda.tensor import Workspace, empty, from_host

    stream = runtime.stream()
    n = x.shape[0]
    out = empty((n, weight.rows), np.float32)
    driver.memset_d8(out.ptr, 0xFF, out.nbytes, stream)  # NaN everywhere: an unwritten element shows
    ws = Workspace(linear_mma.scratch_bytes(weight.rows, weight.cols, n, runtime.context().info.num_sms) + (1 << 20))
    bd = from_host(bias.astype(np.float32)) if bias is not None else None
    linear_mma.linear_mma(out, weight, _activation(x, norm_ss, eps), bd, stream, ws)
    assert ws.offset == 0, "linear_mma must hand its scratch back"
    stream.synchronize()
    return out.to_host()


def run_matvec_slices(weight, x: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
    """matvec_q's rows for x, 16 tokens a launch (the tensor-core mat-vec off, as batch-invariant mode runs it: its
    sums are not yet unit_value.cuh's); a tiled weight's rows from the same matrix in GGUF rows."""
    from infero.backends.cuda import matvec

    if weight.tiled:
        weight, _ = make_weight(Q(weight.ggml_type), weight.rows, weight.cols, False)
    matvec.use_tensor_cores(False)
    try:
        return _matvec_slices(weight, x, bias)
    finally:
        matvec.use_tensor_cores(True)


def _matvec_slices(weight, x: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
    from infero.backends.cuda import driver, matvec, runtime
    from infero.backends.cuda.tensor import Workspace, empty, from_host

    stream = runtime.stream()
    n = x.shape[0]
    out = empty((n, weight.rows), np.float32)
    driver.memset_d8(out.ptr, 0xFF, out.nbytes, stream)
    xd = from_host(np.ascontiguousarray(x, np.float32))
    bd = from_host(bias.astype(np.float32)) if bias is not None else None
    ws = Workspace(16 * weight.cols * 3 + 16 * weight.rows * 4 * 16 + (1 << 20))
    for a in range(0, n, 16):
        b = min(a + 16, n)
        matvec.matvec(out.rows(a, b), weight, xd.rows(a, b), bd, stream, ws)
    stream.synchronize()
    return out.to_host()


def _ids(cases):
    return [f"{t.name}-{r}x{c}-{'tiled' if tiled else 'rows'}" for t, r, c, tiled in cases]


@pytest.mark.gpu
@pytest.mark.parametrize("qtype, rows, cols, tiled", CASES, ids=_ids(CASES))
def test_rows_are_bitwise_the_mat_vecs_and_match_float64(gpu, qtype, rows, cols, tiled):
    from infero.backends.cuda import linear_mma, runtime

    weight, w = make_weight(qtype, rows, cols, tiled)
    rng = np.random.default_rng(cols + rows)
    sms = runtime.context().info.num_sms
    lines, failed = [], False
    for n in TOKEN_COUNTS:
        x = rng.normal(0, 1, size=(n, cols)).astype(np.float32)
        bias = rng.normal(0, 0.5, size=rows).astype(np.float32) if n in (33, 200) else None
        got = run_linear_mma(weight, x, bias)
        want = run_matvec_slices(weight, x, bias)
        _, _, _, xhat = quantize_like_kernel(x)
        err, text = describe(got, xhat @ w.T + (bias if bias is not None else 0.0))
        same = np.array_equal(got.view(np.uint32), want.view(np.uint32))
        differing = int((got.view(np.uint32) != want.view(np.uint32)).sum())
        bad = not (same and err < TIGHT)
        failed |= bad
        lines.append(f"{'FAIL' if bad else 'ok  '} {qtype.name} {rows}x{cols} tiled={tiled} n={n:<3d} "
                     f"splits={linear_mma.splits(rows, cols, n, sms)} bias={bias is not None} "
                     f"bitwise={same} ({differing} differ) {text}")  # fmt: skip
    print("\n".join(lines))
    assert not failed, "linear_mma disagrees with the mat-vec or float64:\n" + "\n".join(lines)


@pytest.mark.gpu
@pytest.mark.parametrize("qtype, cols", [(Q.Q4_K, 4096), (Q.Q6_K, 2048)], ids=["Q4_K", "Q6_K"])
def test_two_stage_buffers_as_a_smaller_gpu_takes_give_the_mat_vecs_bits(gpu, monkeypatch, qtype, cols):
    from infero.backends.cuda import linear_mma

    weight, _ = make_weight(qtype, 1000, cols, False)
    rng = np.random.default_rng(11)
    for n in (33, 512):  # splits of a few stages; one split of every stage, the ring wrapping
        x = rng.normal(0, 1, size=(n, cols)).astype(np.float32)
        want = run_matvec_slices(weight, x, None)
        three = run_linear_mma(weight, x, None)
        with monkeypatch.context() as m:
            m.setattr(linear_mma, "buffers", lambda *_: 2)
            two = run_linear_mma(weight, x, None)
        assert np.array_equal(three.view(np.uint32), want.view(np.uint32)), n
        assert np.array_equal(two.view(np.uint32), want.view(np.uint32)), n


def _inv_rms(norm_ss: np.ndarray, cols: int, eps: float) -> np.ndarray:
    """1 / rms per token as the kernels form it in float32: lane l sums groups l, l + 32, ... in order, then an xor
    butterfly over the 32 lane sums, then 1 / sqrt(total / cols + eps)."""
    f32 = np.float32
    out = []
    for sums in norm_ss.astype(f32):
        lanes = [f32(0)] * 32
        for i, v in enumerate(sums):
            lanes[i % 32] = f32(lanes[i % 32] + v)
        for o in (16, 8, 4, 2, 1):
            lanes = [f32(lanes[lane] + lanes[lane ^ o]) for lane in range(32)]
        out.append(f32(1) / np.sqrt(f32(lanes[0] / f32(cols) + f32(eps))))
    return np.array(out, f32)


@pytest.mark.gpu
@pytest.mark.parametrize("rows, n", [(1000, 40), (14336, 17)], ids=["splits", "one-split"])
def test_a_deferred_norm_scales_each_output_before_the_bias(gpu, rows, n):
    cols, eps = 4096, 1e-5
    weight, _ = make_weight(Q.Q4_K, rows, cols, False)
    rng = np.random.default_rng(5)
    x = rng.normal(0, 1, size=(n, cols)).astype(np.float32)
    norm_ss = rng.uniform(0.5, 60.0, size=(n, cols // 32)).astype(np.float32)
    bias = rng.normal(0, 0.5, size=rows).astype(np.float32)
    plain = run_linear_mma(weight, x, None)
    got = run_linear_mma(weight, x, bias, norm_ss, eps)
    want = (plain * _inv_rms(norm_ss, cols, eps)[:, None]).astype(np.float32) + bias
    assert np.array_equal(got.view(np.uint32), want.astype(np.float32).view(np.uint32))


@pytest.mark.gpu
def test_rejects_what_it_cannot_run_with_a_clear_error(gpu):
    from infero.backends.cuda import linear_mma, runtime
    from infero.backends.cuda.tensor import Workspace, empty

    q4, _ = make_weight(Q.Q4_K, 64, 512, False)
    q2, _ = make_weight(Q.Q2_K, 64, 512, False)
    stream, ws = runtime.stream(), Workspace(1 << 20)
    act = _activation(np.ones((17, 512), np.float32))
    assert not linear_mma.supports(q2, 17) and linear_mma.supports(q4, 17)
    # rows ending inside a span: Q8_0's only
    assert linear_mma.supports(make_weight(Q.Q8_0, 64, 896, False)[0], 17)
    assert not linear_mma.supports(make_weight(Q.Q4_0, 64, 896, False)[0], 17)
    with pytest.raises(ValueError, match="not supported"):
        linear_mma.linear_mma(empty((17, 64), np.float32), q2, act, None, stream, ws)
    with pytest.raises(ValueError, match="out must be float32"):
        linear_mma.linear_mma(empty((17, 32), np.float32), q4, act, None, stream, ws)
    with pytest.raises(ValueError, match="activation_shapes"):
        linear_mma.linear_mma(empty((18, 64), np.float32), q4, act, None, stream, ws)
    with pytest.raises(ValueError, match="bias must be"):
        linear_mma.linear_mma(empty((17, 64), np.float32), q4, act, empty((63,), np.float32), stream, ws)


def test_launches_take_three_buffers_on_the_h200_two_on_the_a100_split_at_most_once_a_stage_borrow_under_16_mib():
    from infero.backends.cuda import linear_mma

    h200_optin, a100_optin, sms = 232448, 166912, 132
    for t in linear_mma.TYPES:
        for n in (17, 32, 33, 64, 512):
            assert linear_mma.buffers(t, n, h200_optin) == 3, (t, n)
            assert linear_mma.buffers(t, n, a100_optin) >= 2, (t, n)
    for rows, cols in ((14336, 4096), (4096, 14336), (1024, 4096), (128256, 4096), (64, 256)):
        for n in (17, 32, 64, 512):
            s = linear_mma.splits(rows, cols, n, sms)
            assert 1 <= s <= min(linear_mma.MAX_SPLITS, cols // linear_mma.STAGE_COLS)
            assert linear_mma.scratch_bytes(rows, cols, n, sms) <= 16 << 20, (rows, cols, n, s)


def test_a_launch_takes_as_many_buffers_as_the_shared_memory_limit_holds_and_none_below_two():
    from infero.backends.cuda import linear_mma

    for t in linear_mma.TYPES:
        for n in (17, 64):
            one = linear_mma.buffer_bytes(t, n)
            static = 4 * 64  # linear_mma.cu's inv[TOK]
            assert linear_mma.buffers(t, n, 3 * one + static) == 3
            assert linear_mma.buffers(t, n, 3 * one + static - 1) == 2
            assert linear_mma.buffers(t, n, 2 * one + static) == 2
            assert linear_mma.buffers(t, n, 2 * one + static - 1) == 0
