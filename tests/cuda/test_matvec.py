"""The decode mat-vec against numpy on gguf's own dequantization, for every weight type and 1..16 tokens.

Three checks per case:
1. Against the same math in float64: x quantized to two int8 planes exactly as the kernel does (per 32
   elements, d0 = amax / 127, q0 = rint(x / d0); then the residual x - d0 q0 at D = d0 / 256), times gguf's
   dequantized weights. The integer dot products are exact, so only fp32 rounding of the per-unit scale products
   and the fp32 sum remain: ~1e-7 measured (host emulation of the kernel's arithmetic); bound 1e-5. Float weights
   (F32/F16/BF16) keep x in float: same bound against x @ W^T.
2. Against x @ W^T in float64 (block formats): the error is that of the int8 activation planes. One plane (d =
   amax / 127) leaves a rounding error of rms amax / (127 sqrt(12)), ~5.4e-3 of a Gaussian x and 0.6-1.2% of
   real LLM hidden states (their outlier channels set amax); that alone put SmolLM2's logits 1-7% off. The
   residual plane's scale is d0 / 256, so the error falls to ~1e-5; the bound here is 1e-3, which one
   plane fails on every format, while a wrong nibble, scale or offset gives errors of order 1.
3. Batch invariance: row i of an n-token call is bitwise the 1-token call on x[i].
Outputs are poisoned with NaN before every launch, so an element the kernel never writes shows.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize
from tiny_gguf import ALL_TYPES, encode_weight

pytestmark = pytest.mark.gpu

TIGHT = 1e-5
INT8_BOUND = 1e-3
TOKEN_COUNTS = (1, 2, 3, 8, 16)
FLOAT_TYPES = (Q.F32, Q.F16, Q.BF16)
K_TYPES = (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS)
SMALL_BLOCK_TYPES = [t for t in ALL_TYPES if t not in K_TYPES]
# (rows, cols). 999 and 3001 rows are odd (no rows-per-warp or rows-per-block multiple); 3001 rows also takes
# the two-rows-per-warp variant at n = 1; 896 columns is not a multiple of 256 (28 of 32 lanes busy); 14336
# columns with 7 rows walks 14 units per lane in one-warp blocks; 1003 and 1004 columns (float weights) are not
# multiples of 8 (element-wise loads throughout; F32 with 1004: 16-byte loads and one element-wise tail unit).
SHAPES = [(999, 4096), (3001, 512), (7, 14336)]
SMALL_BLOCK_SHAPES = [(257, 896)]
FLOAT_SHAPES = [(33, 1003), (33, 1004)]
# Q4_K (its own kernel, tiles of 16 rows and pairs of superblocks): 40 rows end inside a tile, 768 columns are an
# odd number of superblocks. Q6_K's (7, 14336) and (999, 4096) above take its tensor-core kernel too (rows of a
# multiple of 2048), (3001, 512) matvec_q.
CASES = (
    [(t, s) for t in ALL_TYPES for s in SHAPES]
    + [(Q.Q4_K, (40, 768))]
    + [(t, s) for t in SMALL_BLOCK_TYPES for s in SMALL_BLOCK_SHAPES]
    + [(t, s) for t in FLOAT_TYPES for s in FLOAT_SHAPES]
)


@functools.cache
def weight_case(qtype: Q, rows: int, cols: int, seed: int = 0):
    """(QuantWeight on the GPU, float64 dequantized [rows, cols]) for random valid blocks of qtype."""
    from infero.backends.cuda.tensor import QuantWeight, from_host

    rng = np.random.default_rng(rows * 7919 + cols * 31 + int(qtype) + 1_000_003 * seed)
    data, _ = encode_weight(rng.normal(0, 0.05, size=(rows, cols)).astype(np.float32), qtype, rng)
    raw = np.ascontiguousarray(data).view(np.uint8).reshape(rows, -1)
    w = np.asarray(dequantize(raw, qtype), np.float64).reshape(rows, cols)
    assert np.isfinite(w).all()
    return QuantWeight(from_host(raw), int(qtype), rows, cols), w


def quantize_like_kernel(x: np.ndarray):
    """The kernel's activation format of x [n, cols] (act_quant.cuh), in numpy: per 32 elements d0 = amax / 127,
    q0 = rint(x / d0); D = d0 / 256, q1 = clip(rint(r / D), -127, 127) for the residual r = x - d0 q0 (rounded once
    to float32, as the kernel's fmaf; x - d0 q0 is exact in float64). Returns (q int8 [2, n, cols], D float32
    [n, cols/32], half sums of 256 q0 + q1 int32 [n, cols/32, 2], x as the kernel sees it: D (256 q0 + q1) in
    float64)."""
    n, cols = x.shape
    g = x.reshape(n, cols // 32, 32).astype(np.float32)
    d0 = (np.abs(g).max(-1, keepdims=True) / np.float32(127)).astype(np.float32)
    d = (d0 * np.float32(1 / 256)).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        q0 = np.where(d0 == 0, 0, np.rint(g / d0)).astype(np.int32)
        r = (g.astype(np.float64) - d0.astype(np.float64) * q0).astype(np.float32)
        q1 = np.where(d == 0, 0, np.clip(np.rint(r / d), -127, 127)).astype(np.int32)
    combined = 256 * q0 + q1
    sums = combined.reshape(n, cols // 32, 2, 16).sum(-1)
    xhat = combined * d.astype(np.float64)
    q = np.stack([q0.reshape(n, cols), q1.reshape(n, cols)]).astype(np.int8)
    return q, d[..., 0], sums, xhat.reshape(n, cols)


def run_matvec(weight, x, bias: np.ndarray | None) -> np.ndarray:
    """out [n, rows] for x (numpy, or a DeviceTensor already on the GPU), poisoned with NaN before the launch."""
    from infero.backends.cuda import driver, matvec, runtime
    from infero.backends.cuda.tensor import DeviceTensor, Workspace, empty, from_host

    stream = runtime.stream()
    n = x.shape[0]
    out = empty((n, weight.rows), np.float32)
    driver.memset_d8(out.ptr, 0xFF, out.nbytes, stream)  # NaN everywhere: an unwritten element shows
    ws = Workspace(n * weight.cols * 3 + (1 << 16))  # two int8 planes and their scales
    xd = x if isinstance(x, DeviceTensor) else from_host(np.ascontiguousarray(x, np.float32))
    bd = from_host(bias.astype(np.float32)) if bias is not None else None
    matvec.matvec(out, weight, xd, bd, stream, ws)
    assert ws.offset == 0, "matvec must hand its scratch back"
    stream.synchronize()
    return out.to_host()


def run_matvec_many(weights, x: np.ndarray, biases) -> list[np.ndarray]:
    """matvec_many's outputs for x (numpy), each poisoned with NaN before the launch."""
    from infero.backends.cuda import driver, matvec, runtime
    from infero.backends.cuda.tensor import Workspace, empty, from_host

    stream = runtime.stream()
    n = x.shape[0]
    outs = [empty((n, w.rows), np.float32) for w in weights]
    for out in outs:
        driver.memset_d8(out.ptr, 0xFF, out.nbytes, stream)
    ws = Workspace(n * weights[0].cols * 3 + (1 << 16))
    bd = [from_host(b.astype(np.float32)) if b is not None else None for b in biases]
    matvec.matvec_many(outs, weights, from_host(np.ascontiguousarray(x, np.float32)), bd, stream, ws)
    assert ws.offset == 0, "matvec_many must hand its scratch back"
    stream.synchronize()
    return [out.to_host() for out in outs]


def rel_err(out: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(out.astype(np.float64) - ref) / max(np.linalg.norm(ref), 1e-30))


def describe(out: np.ndarray, ref: np.ndarray) -> str:
    diff = np.abs(np.nan_to_num(out, nan=np.inf).astype(np.float64) - ref)
    worst = np.unravel_index(int(np.argmax(diff)), diff.shape)
    return (f"rel_err {rel_err(out, ref):.2e}  max_abs_err {diff.max():.3e} at (token {worst[0]}, row {worst[1]})  "
            f"max|ref| {np.abs(ref).max():.3e}")  # fmt: skip


@pytest.mark.parametrize("qtype, shape", CASES, ids=[f"{t.name}-{r}x{c}" for t, (r, c) in CASES])
def test_matvec_matches_reference_and_is_batch_invariant(gpu, qtype, shape):
    rows, cols = shape
    weight, w = weight_case(qtype, rows, cols)
    rng = np.random.default_rng(rows + cols)
    x = rng.normal(0, 1, size=(max(TOKEN_COUNTS), cols)).astype(np.float32)
    x[1, 32:64] = 0.0  # an all-zero group (d = 0) must give zeros, not NaN
    bias = rng.normal(0, 0.5, size=rows).astype(np.float32) if int(qtype) % 2 == 0 else None
    b = bias.astype(np.float64) if bias is not None else 0.0
    quantized = qtype not in FLOAT_TYPES
    exact_x = quantize_like_kernel(x)[3] if quantized else x.astype(np.float64)
    ref_tight = exact_x @ w.T + b
    ref_float = x.astype(np.float64) @ w.T + b

    singles = [run_matvec(weight, x[i : i + 1], bias)[0] for i in range(max(TOKEN_COUNTS))]
    failures, report = [], []
    for n in TOKEN_COUNTS:
        out = run_matvec(weight, x[:n], bias)
        label = f"{qtype.name} {rows}x{cols} n={n} bias={bias is not None}"
        nans = int(np.isnan(out).sum())
        tight = rel_err(out, ref_tight[:n]) if nans == 0 else float("inf")
        line = f"{label}: NaN {nans}; vs same-math ref {describe(out, ref_tight[:n])}"
        if quantized:
            line += f"; vs float ref rel_err {rel_err(out, ref_float[:n]):.2e}"
        report.append(line)
        if nans or tight >= TIGHT:
            failures.append(f"{line}  [bound {TIGHT:g}]")
        if quantized and not rel_err(out, ref_float[:n]) < INT8_BOUND:
            failures.append(f"{line}  [float bound {INT8_BOUND:g}]")
        single = np.stack(singles[:n])
        differ = np.argwhere(out.view(np.uint32) != single.view(np.uint32))
        if len(differ):
            t, r = differ[0]
            failures.append(f"{label}: not batch invariant at {len(differ)} elements, first (token {t}, row {r}): "
                            f"{out[t, r]!r} in the batch vs {single[t, r]!r} alone")  # fmt: skip
    print("\n".join(report))
    assert not failures, "\n".join(failures)


# SmolLM2-135M's linears (hidden 576, ffn 1536, 3 KV heads of 64; Q4_1 matrices, Q8_0 tied output, whose 576-wide
# rows are 18 34-byte blocks, not 4-byte aligned; 3001 of its 49152 rows) with activations shaped like real hidden
# states: a few channels 20-60x the rest, as in every LLM's residual stream. One int8 plane gave 0.6-2.5% per
# linear on SmolLM2's own activations and 1-7% at the logits; on these it gives 1-3% (bound 1e-3).
REAL_SHAPES = [(Q.Q4_1, (576, 576)), (Q.Q4_1, (192, 576)), (Q.Q4_1, (1536, 576)), (Q.Q4_1, (576, 1536)),
               (Q.Q8_0, (3001, 576)), (Q.Q4_K, (576, 1536))]  # fmt: skip


def llm_like_activations(n: int, cols: int, seed: int) -> np.ndarray:
    """Gaussian rows with fixed outlier channels (the same for every token, of either sign) and a per-token
    scale, like the inputs of an LLM's linear layers."""
    rng = np.random.default_rng(seed)
    x = rng.normal(0, 1, size=(n, cols))
    channels = rng.choice(cols, size=max(2, cols // 96), replace=False)
    x[:, channels] *= rng.uniform(20, 60, size=channels.size) * rng.choice([-1, 1], size=channels.size)
    return (x * rng.uniform(0.2, 5, size=(n, 1))).astype(np.float32)


@pytest.mark.parametrize("qtype, shape", REAL_SHAPES, ids=[f"{t.name}-{r}x{c}" for t, (r, c) in REAL_SHAPES])
@pytest.mark.parametrize("n", [1, 10])
def test_matvec_is_accurate_on_activations_with_outliers(gpu, qtype, shape, n):
    rows, cols = shape
    weight, w = weight_case(qtype, rows, cols)
    x = llm_like_activations(n, cols, seed=rows + n)
    out = run_matvec(weight, x, None)
    ref = x.astype(np.float64) @ w.T
    tight = quantize_like_kernel(x)[3] @ w.T
    label = f"{qtype.name} {rows}x{cols} n={n}"
    assert not np.isnan(out).any(), f"{label}: NaN in the output"
    assert rel_err(out, tight) < TIGHT, f"{label}: vs same-math ref {describe(out, tight)}"
    per_token = [rel_err(out[i], ref[i]) for i in range(n)]
    assert max(per_token) < INT8_BOUND, f"{label}: vs float ref, per token {np.round(per_token, 5)}"


@pytest.mark.parametrize("qtype", FLOAT_TYPES, ids=[t.name for t in FLOAT_TYPES])
def test_float_matvec_does_not_depend_on_alignment(gpu, qtype):
    """x 4 bytes past 16-byte alignment takes the element-wise loads: bitwise the same result as 16-byte loads."""
    from infero.backends.cuda.tensor import DeviceTensor, from_host

    rows, cols, n = 65, 512, 3
    weight, _ = weight_case(qtype, rows, cols)
    x = np.random.default_rng(5).normal(0, 1, size=(n, cols)).astype(np.float32)
    aligned = run_matvec(weight, x, None)
    padded = from_host(np.concatenate([np.zeros(1, np.float32), x.reshape(-1)]))
    shifted = DeviceTensor(padded.ptr + 4, (n, cols), np.dtype(np.float32), padded)
    unaligned = run_matvec(weight, shifted, None)
    differ = np.argwhere(aligned.view(np.uint32) != unaligned.view(np.uint32))
    assert not len(differ), f"{qtype.name}: {len(differ)} elements differ, first {differ[0]}"


def test_activation_quantization_matches_numpy(gpu):
    """The int8 activations, scales and half sums the mat-vec reads are bitwise numpy's."""
    from infero.backends.cuda import driver, matvec, runtime
    from infero.backends.cuda.tensor import empty, from_host

    rng = np.random.default_rng(3)
    n, cols = 5, 4096 + 96
    x = (rng.normal(0, 1, size=(n, cols)) * rng.uniform(0.01, 100, size=(n, 1))).astype(np.float32)
    x[0, :32] = 0.0
    x[2, 64:96] = -3.0  # exact ties of amax
    stream = runtime.stream()
    xd = from_host(x)
    q_shape, s_shape = matvec.activation_shapes(n, cols)
    xq, xs = empty(q_shape, np.int8), empty(s_shape, np.int32)
    driver.memset_d8(xs.ptr, 0xFF, xs.nbytes, stream)
    matvec.quantize(xq, xs, xd, stream)
    stream.synchronize()
    assert_quantized_like_numpy(xq, xs, x)


def assert_quantized_like_numpy(xq, xs, x: np.ndarray) -> None:
    q, d, sums, _ = quantize_like_kernel(x)
    n, cols = x.shape
    got_q, got_s = xq.to_host(), xs.to_host().reshape(n, cols // 32, 2, 2)
    got_d = got_s[..., 0, 0].view(np.float32)
    assert np.array_equal(got_s[..., 0, 0], got_s[..., 1, 0]), "the two halves of a group carry different D"
    bad_q = np.argwhere(got_q != q)
    assert not len(bad_q), (
        f"{len(bad_q)} int8 values differ, first at {bad_q[0]}: {got_q[tuple(bad_q[0])]} vs {q[tuple(bad_q[0])]}"
    )
    bad_d = np.argwhere(got_d.view(np.uint32) != d.view(np.uint32))
    assert not len(bad_d), (
        f"{len(bad_d)} scales differ, first at {bad_d[0]}: {got_d[tuple(bad_d[0])]!r} vs {d[tuple(bad_d[0])]!r}"
    )
    assert np.array_equal(got_s[..., 1], sums), "half sums differ"


@pytest.mark.parametrize("n,cols", [(1, 576), (3, 896), (16, 4096), (2, 14336)])
def test_norm_and_swiglu_write_the_same_activation_format_as_quantize(gpu, n, cols):
    """add_rms_norm and swiglu, asked to, also write their output quantized: bitwise what quantize writes for
    that output, and numpy's."""
    from infero.backends.cuda import elementwise, matvec, runtime
    from infero.backends.cuda.tensor import empty, from_host

    rng = np.random.default_rng(n * cols)
    stream = runtime.stream()
    x = (rng.normal(0, 1, size=(n, cols)) * rng.uniform(0.1, 10, size=(1, cols))).astype(np.float32)
    residual = rng.normal(0, 1, size=(n, cols)).astype(np.float32)
    weight = rng.uniform(0.5, 2, size=cols).astype(np.float32)
    cases = []
    out, res = empty((n, cols), np.float32), from_host(residual)
    q_shape, s_shape = matvec.activation_shapes(n, cols)
    quantized = (empty(q_shape, np.int8), empty(s_shape, np.int32))
    elementwise.add_rms_norm(out, res, from_host(x), from_host(weight), 1e-5, stream, quantized)
    cases.append(("add_rms_norm", out, quantized))
    gate, up = rng.normal(0, 2, size=(2, n, cols)).astype(np.float32)
    out2 = empty((n, cols), np.float32)
    quantized2 = (empty(q_shape, np.int8), empty(s_shape, np.int32))
    elementwise.swiglu(out2, from_host(gate), from_host(up), stream, quantized2)
    cases.append(("swiglu", out2, quantized2))
    for name, y, (xq, xs) in cases:
        stream.synchronize()
        assert_quantized_like_numpy(xq, xs, y.to_host())
        print(f"{name} n={n} cols={cols}: quantized output bitwise numpy's")


def test_matvec_rejects_more_than_16_tokens(gpu):
    from infero.backends.cuda import matvec, runtime
    from infero.backends.cuda.tensor import Workspace, empty

    weight, _ = weight_case(Q.Q8_0, 64, 256)
    x = empty((17, 256), np.float32)
    out = empty((17, 64), np.float32)
    with pytest.raises(ValueError, match="at most 16"):
        matvec.matvec(out, weight, x, None, runtime.stream(), Workspace(1 << 16))


# The tensor-core mat-vecs (matvec_mma and its fused forms matvec_glu, matvec_norm, matvec_rope) compute a row as
# unit_value.cuh defines it, as matvec_q does: bitwise matvec_q's row on the same activation (matvec_q forced by
# turning the tensor cores off, as batch-invariant mode does), on GGUF rows and tiled, 1-16 tokens, with and
# without a bias, a deferred norm's factor after the sum. 768 columns: three superblocks (a pair's second missing);
# 8448: 33, over 8 warps; 40 rows end inside a tile.
MMA_BITWISE_CASES = [(Q.Q4_K, 64, 4096), (Q.Q4_K, 40, 768), (Q.Q4_K, 48, 8448), (Q.Q4_K, 32, 8192),
                     (Q.Q6_K, 48, 2048), (Q.Q6_K, 40, 4096)]  # fmt: skip


def on_matvec_q(fn, *args):
    """fn(*args) with every block format on matvec_q."""
    from infero.backends.cuda import matvec

    matvec.use_tensor_cores(False)
    try:
        return fn(*args)
    finally:
        matvec.use_tensor_cores(True)


def bitwise_failures(label: str, got: np.ndarray, ref: np.ndarray) -> list[str]:
    bits = np.uint32 if got.dtype == np.float32 else np.uint16
    if np.isnan(ref).any():
        return [f"{label}: {int(np.isnan(ref).sum())} NaN in the reference"]
    differ = np.argwhere(got.view(bits) != ref.view(bits))
    if not len(differ):
        return []
    i = tuple(differ[0])
    return [f"{label}: {len(differ)} elements differ, first at {list(i)}: {got[i]!r} against {ref[i]!r}"]


def tensor_core_layouts(qtype: Q, rows: int, cols: int) -> dict:
    """The case's weight in GGUF rows, and tiled where the layout holds the shape."""
    from infero.backends.cuda import matvec, weight_layout

    weight, _ = weight_case(qtype, rows, cols)
    assert matvec.takes_mma(int(qtype), cols), "the case must take the tensor cores"
    layouts = {"GGUF rows": weight}
    if weight_layout.tiles(int(qtype), rows, cols):
        layouts["tiled"] = weight_layout.upload(weight.data.to_host(), int(qtype), rows, cols)
        assert layouts["tiled"].tiled
    return layouts


@pytest.mark.parametrize(
    "qtype, rows, cols", MMA_BITWISE_CASES, ids=[f"{t.name}-{r}x{c}" for t, r, c in MMA_BITWISE_CASES]
)
def test_tensor_core_matvec_is_bitwise_matvec_q(gpu, qtype, rows, cols):
    layouts = tensor_core_layouts(qtype, rows, cols)
    weight = layouts["GGUF rows"]
    rng = np.random.default_rng(rows + cols)
    x = (rng.normal(0, 1, size=(16, cols)) * rng.uniform(0.1, 10, size=(1, cols))).astype(np.float32)
    x[2, 64:96] = 0.0  # a zero group (D = 0)
    bias = rng.normal(0, 0.5, size=rows).astype(np.float32)
    failures = []
    for n in (1, 2, 3, 4, 7, 16):
        for b in (None, bias):
            ref = on_matvec_q(run_matvec, weight, x[:n], b)
            for name, w in layouts.items():
                got = run_matvec(w, x[:n], b)
                failures += bitwise_failures(f"{qtype.name} {name} n={n} bias={b is not None}", got, ref)
    assert not failures, "\n".join(failures)


def inv_rms_like_kernel(norm_ss: np.ndarray, cols: int, eps: float) -> np.ndarray:
    """The readers' 1 / rms [n] from the groups' sums of squares, as stage_activation forms it: lane i adds groups
    i, i + 32, ... in order, a butterfly, then 1 / sqrt(total / cols + eps), all float32."""
    n, groups = norm_ss.shape
    lanes = np.zeros((n, 32), np.float32)
    for i in range(groups):
        lanes[:, i % 32] = (lanes[:, i % 32] + norm_ss[:, i]).astype(np.float32)
    total = butterfly_sum(lanes)
    return (np.float32(1) / np.sqrt((total / np.float32(cols) + np.float32(eps)).astype(np.float32))).astype(np.float32)


def scaled_matvec_q_row(weight, act, inv: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """The mat-vec of a deferred norm's activation without its norm (q, s), times the factor inv [n, 1], plus the
    bias, as float32 operations."""
    from infero.backends.cuda import matvec, runtime
    from infero.backends.cuda.tensor import Workspace, empty

    n, stream = act.q.shape[1], runtime.stream()
    out = empty((n, weight.rows), np.float32)
    matvec.matvec(out, weight, empty((n, weight.cols), np.float32), None, stream, Workspace(1 << 16), (act.q, act.s))
    stream.synchronize()
    return ((out.to_host() * inv).astype(np.float32) + bias).astype(np.float32)


@pytest.mark.parametrize("qtype, rows, cols", [(Q.Q4_K, 64, 4096), (Q.Q4_K, 64, 768), (Q.Q6_K, 64, 2048)],
                         ids=["Q4_K-4096", "Q4_K-768", "Q6_K-2048"])  # fmt: skip
def test_tensor_core_readers_of_a_deferred_norm_are_bitwise_matvec_q_times_its_factor(gpu, qtype, rows, cols):
    from infero.backends.cuda import driver, elementwise, matvec, runtime
    from infero.backends.cuda.tensor import Workspace, empty, from_host

    (gate, _), (up, _) = weight_case(qtype, rows, cols, seed=5), weight_case(qtype, rows, cols, seed=6)
    rng = np.random.default_rng(rows * cols + 1)
    r = (rng.normal(0, 1, size=(16, cols)) * rng.uniform(0.1, 30, size=(1, cols))).astype(np.float32)
    norm_weight = rng.uniform(0.2, 2, size=cols).astype(np.float32)
    biases = [rng.normal(0, 0.5, size=rows).astype(np.float32) for _ in range(2)]
    stream, failures = runtime.stream(), []
    for n in (1, 2, 3, 16):  # staged below 3 tokens, read in place from 3 on (add_rms_norm's DEFER form)
        act, _ = deferred_activation(r[:n], norm_weight, 1e-5)
        inv = inv_rms_like_kernel(act.norm_ss.to_host(), cols, 1e-5)[:, None]
        dummy = empty((n, cols), np.float32)
        ref_g = on_matvec_q(scaled_matvec_q_row, gate, act, inv, biases[0])
        ref_u = on_matvec_q(scaled_matvec_q_row, up, act, inv, biases[1])
        out = empty((n, rows), np.float32)
        driver.memset_d8(out.ptr, 0xFF, out.nbytes, stream)
        matvec.matvec(out, gate, dummy, from_host(biases[0]), stream, Workspace(1 << 16), act)
        stream.synchronize()
        failures += bitwise_failures(f"matvec n={n}", out.to_host(), ref_g)
        if n > 2:  # matvec_glu takes one or two tokens
            continue
        glu = empty((n, rows), np.float32)
        driver.memset_d8(glu.ptr, 0xFF, glu.nbytes, stream)
        glu_q = tuple(empty(s, d) for s, d in zip(matvec.activation_shapes(n, rows), (np.int8, np.int32), strict=True))
        matvec.matvec_glu(glu, gate, up, dummy, tuple(from_host(b) for b in biases), act, glu_q, stream)
        swiglu = empty((n, rows), np.float32)
        elementwise.swiglu(swiglu, from_host(ref_g), from_host(ref_u), stream)
        stream.synchronize()
        failures += bitwise_failures(f"matvec_glu n={n}", glu.to_host(), swiglu.to_host())
    assert not failures, "\n".join(failures)


def rope_outputs(weights, x: np.ndarray) -> list[np.ndarray]:
    """matvec_rope's q, k, v and k / v caches for q, k and v of heads of 32 (neox pairs), two tokens' positions, the
    second token padding (slot -1), every output poisoned with NaN first."""
    from infero.backends.cuda import driver, matvec, runtime
    from infero.backends.cuda.tensor import Workspace, empty, from_host

    n, head_dim, stream = x.shape[0], 32, runtime.stream()
    outs = [empty((n, w.rows), np.float32) for w in weights]
    caches = [empty((4, 8, weights[1].rows // head_dim, head_dim), np.float16) for _ in range(2)]
    for t in outs + caches:
        driver.memset_d8(t.ptr, 0xFF, t.nbytes, stream)
    positions, slots = from_host(np.array([1234, 7][:n], np.int32)), from_host(np.array([3, -1][:n], np.int64))
    inv_freq = from_host((1e4 ** (-np.arange(0, head_dim, 2) / head_dim)).astype(np.float32))
    groups = [[0, 1, 2]] if matvec.mixes(tuple(w.ggml_type for w in weights), x.shape[1]) else [[0, 1], [2]]
    biases = [from_host(np.linspace(-1, 1, w.rows, dtype=np.float32)) for w in weights]
    for g in groups:
        matvec.matvec_rope([outs[i] for i in g], [weights[i] for i in g], tuple("qkv"[i] for i in g), from_host(x),
                           [biases[i] for i in g], positions, inv_freq, 1.0, "neox", head_dim, caches[0], caches[1],
                           slots, stream, Workspace(1 << 20))  # fmt: skip
    stream.synchronize()
    return [t.to_host() for t in outs + caches]


# Gate, up and SwiGLU (matvec_glu), the residual add (matvec_norm) and q/k/v with the rotary epilogue (matvec_rope;
# q and k Q4_K with v Q6_K: one mixed launch at 2048 columns) against matvec_q's rows and the same epilogues.
FUSED_CASES = [((Q.Q4_K,) * 3, 128, 768), ((Q.Q6_K,) * 3, 64, 2048), ((Q.Q4_K, Q.Q4_K, Q.Q6_K), 64, 2048)]


@pytest.mark.parametrize("types, rows, cols", FUSED_CASES, ids=["Q4_K", "Q6_K", "Q4_K-Q6_K-mixed"])
def test_fused_tensor_core_matvecs_are_bitwise_matvec_q_and_their_epilogue(gpu, types, rows, cols):
    from infero.backends.cuda import elementwise, matvec, runtime
    from infero.backends.cuda.tensor import empty, from_host

    qtype = types[0]
    (gate, _), (up, _) = weight_case(qtype, rows, cols, seed=1), weight_case(qtype, rows, cols, seed=2)
    rng = np.random.default_rng(rows * cols)
    x = (rng.normal(0, 1, size=(2, cols)) * rng.uniform(0.1, 10, size=(1, cols))).astype(np.float32)
    biases = [rng.normal(0, 0.5, size=rows).astype(np.float32) for _ in range(2)]
    residual0 = rng.normal(0, 3, size=(2, rows)).astype(np.float32)
    norm_weight = from_host(rng.uniform(0.2, 2, size=rows).astype(np.float32))
    stream, failures = runtime.stream(), []
    for n in (1, 2):
        lin_g, lin_u = (on_matvec_q(run_matvec, w, x[:n], b) for w, b in ((gate, biases[0]), (up, biases[1])))
        quantized = tuple(
            empty(s, d) for s, d in zip(matvec.activation_shapes(n, cols), (np.int8, np.int32), strict=True)
        )
        matvec.quantize(*quantized, from_host(x[:n]), stream)
        glu = empty((n, rows), np.float32)
        glu_q = tuple(empty(s, d) for s, d in zip(matvec.activation_shapes(n, rows), (np.int8, np.int32), strict=True))
        matvec.matvec_glu(glu, gate, up, from_host(x[:n]), tuple(from_host(b) for b in biases), quantized, glu_q,
                          stream)  # fmt: skip
        swiglu = empty((n, rows), np.float32)
        elementwise.swiglu(swiglu, from_host(lin_g), from_host(lin_u), stream)
        residual = from_host(residual0[:n])
        out = matvec.Activation(*deferred_buffers(n, rows), 1e-5)
        matvec.matvec_norm(residual, gate, from_host(x[:n]), quantized, norm_weight, out, stream)
        plain = on_matvec_q(run_matvec, gate, x[:n], None)
        stream.synchronize()
        failures += bitwise_failures(f"matvec_glu n={n}", glu.to_host(), swiglu.to_host())
        failures += bitwise_failures(
            f"matvec_norm n={n}", residual.to_host(), (residual0[:n] + plain).astype(np.float32)
        )
        weights = [gate] + [weight_case(t, rows // 2, cols, seed=3 + i)[0] for i, t in enumerate(types[1:])]
        fused = rope_outputs(weights, x[:n])
        alone = on_matvec_q(rope_outputs, weights, x[:n])
        for name, got, ref in zip(("q", "k", "v", "k cache", "v cache"), fused, alone, strict=True):
            failures += bitwise_failures(f"matvec_rope {name} n={n}", np.nan_to_num(got), np.nan_to_num(ref))
    assert not failures, "\n".join(failures)


# One launch for several matrices that read the same x (q/k/v, gate/up). Segment row counts that are odd or not
# multiples of a block's rows check that no warp straddles two matrices; equal row counts get different weights
# (seed), so a swapped segment shows. The grouped launch is planned on the total rows, so it often runs another
# variant than the separate ones: bitwise equality also pins the variant-independent reduction order.
GROUPS = [
    (Q.Q8_0, (896, 128, 128), 896, (True, True, True)),  # Qwen2.5-0.5B's q/k/v, with their biases
    (Q.Q8_0, (4864, 4864), 896, (False, False)),  # its gate/up
    (Q.Q4_K, (1024, 4096, 4096), 4096, (False, False, False)),
    (Q.Q4_K, (40, 17, 1000), 768, (True, False, True)),  # tiles of 16 rows cut short; three superblocks a row
    (Q.Q6_K, (999, 1001), 1024, (False, True)),
    (Q.Q6_K, (40, 17, 1000), 2048, (True, False, True)),  # its tensor-core kernel: tiles cut short, biases
    (Q.IQ4_NL, (3, 257, 65), 512, (True, False, True)),
    (Q.Q3_K, (129, 7, 300), 2048, (False, True, False)),
]


@pytest.mark.parametrize(
    "qtype, rows, cols, with_bias", GROUPS, ids=[f"{t.name}-{'+'.join(map(str, r))}x{c}" for t, r, c, _ in GROUPS]
)
def test_grouped_matvec_is_bitwise_the_separate_matvecs(gpu, qtype, rows, cols, with_bias):
    weights = [weight_case(qtype, r, cols, seed=i)[0] for i, r in enumerate(rows)]
    rng = np.random.default_rng(sum(rows) + cols)
    biases = [
        rng.normal(0, 0.5, size=r).astype(np.float32) if b else None for r, b in zip(rows, with_bias, strict=True)
    ]
    x = rng.normal(0, 1, size=(16, cols)).astype(np.float32)
    failures = []
    for n in (1, 3, 16):
        grouped = run_matvec_many(weights, x[:n], biases)
        for i, (weight, bias, out) in enumerate(zip(weights, biases, grouped, strict=True)):
            alone = run_matvec(weight, x[:n], bias)
            label = f"{qtype.name} segment {i} ({weight.rows}x{cols}) n={n}"
            if np.isnan(out).any():
                failures.append(f"{label}: {int(np.isnan(out).sum())} NaN (unwritten) elements")
            differ = np.argwhere(out.view(np.uint32) != alone.view(np.uint32))
            if len(differ):
                t, r = differ[0]
                failures.append(f"{label}: {len(differ)} elements differ from the separate launch, first (token "
                                f"{t}, row {r}): {out[t, r]!r} grouped vs {alone[t, r]!r} alone")  # fmt: skip
    assert not failures, "\n".join(failures)


# q/k/v of a decode step with rotary_store_kv's work in the mat-vec's epilogue: bitwise matvec_many followed by
# rotary_store_kv (both tested against numpy above and in test_elementwise.py), for both pairings, biases, one and
# two tokens, q and k of one type with v of another (Q4_K_M's Q6_K layers: two launches), positions far out and a
# padding token (slot -1) that writes nothing to the cache.
# deferred: x arrives as matvec_norm writes it (residual * norm weight, the norm's 1 / rms left to the reader).
ROPE_CASES = [
    ("interleaved", ((Q.Q4_K, Q.Q4_K, Q.Q6_K)), 8, 2, 128, 256, False),  # llama-3.1-8b's shapes, scaled down
    ("neox", (Q.Q8_0, Q.Q8_0, Q.Q8_0), 14, 2, 64, 896, True),  # qwen2.5-0.5b's, with its biases
    ("interleaved", (Q.Q4_1, Q.Q4_1, Q.Q4_1), 9, 3, 64, 576, False),  # SmolLM2's
    ("neox", (Q.Q6_K, Q.Q6_K, Q.Q4_K), 4, 4, 128, 512, True),
    ("neox", (Q.Q4_K, Q.Q4_K, Q.Q4_K), 4, 2, 64, 768, True),  # Q4_K's tiles of neox pairs; three superblocks a row
    ("neox", (Q.Q6_K, Q.Q6_K, Q.Q6_K), 4, 2, 64, 2048, True),  # Q6_K on the tensor cores (rows of 2048 and more)
    ("interleaved", (Q.Q4_K, Q.Q4_K, Q.Q6_K), 4, 2, 128, 4096, False),  # llama-3.1-8b's width: one mixed launch
    ("neox", (Q.Q4_K, Q.Q4_K, Q.Q6_K), 4, 2, 64, 2048, True),  # mixed, neox pairs and biases
]
ROPE_CASES = [case + (False,) for case in ROPE_CASES] + [
    ("interleaved", (Q.Q4_K, Q.Q4_K, Q.Q6_K), 4, 2, 128, 4096, False, True),  # the 8B's q/k/v after matvec_norm
    ("neox", (Q.Q4_K, Q.Q4_K, Q.Q4_K), 4, 2, 64, 768, True, True),
]


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("pairing, types, heads, kv_heads, head_dim, cols, with_bias, deferred", ROPE_CASES)
def test_matvec_rope_is_bitwise_matvec_then_rotary_store_kv(gpu, n, pairing, types, heads, kv_heads, head_dim,
                                                              cols, with_bias, deferred):  # fmt: skip
    from infero.backends.cuda import driver, elementwise, matvec, runtime
    from infero.backends.cuda.tensor import Workspace, empty, from_host

    rng = np.random.default_rng(heads * 100 + head_dim + cols + n)
    rows = (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim)
    weights = [weight_case(t, r, cols, seed=i)[0] for i, (t, r) in enumerate(zip(types, rows, strict=True))]
    biases = [from_host(rng.normal(0, 0.5, size=r).astype(np.float32)) if with_bias else None for r in rows]
    x_host = rng.normal(0, 1, size=(n, cols)).astype(np.float32)
    x = from_host(x_host)
    norm_weight = rng.uniform(0.5, 2, size=cols).astype(np.float32)
    quantized = deferred_activation(x_host, norm_weight, 1e-5)[0] if deferred else None
    positions = from_host(np.array([31000, 5][:n], np.int32))
    slots = from_host(np.array([37, -1][:n], np.int64))  # the second token is padding
    inv_freq = from_host((1e6 ** (-np.arange(0, head_dim, 2) / head_dim)).astype(np.float32))
    mscale = 1.0 if pairing == "interleaved" else 1.1
    stream, cache_shape = runtime.stream(), (5, 16, kv_heads, head_dim)

    def fresh(shape, dtype):
        t = empty(shape, dtype)
        driver.memset_d8(t.ptr, 0xFF, t.nbytes, stream)  # NaN: what is left unwritten shows
        return t

    # Reference: one launch per type, then rotary_store_kv over the three outputs.
    ref = [fresh((n, r), np.float32) for r in rows]
    ref_k, ref_v = fresh(cache_shape, np.float16), fresh(cache_shape, np.float16)
    groups = {}
    for i, t in enumerate(types):
        groups.setdefault(t, []).append(i)
    ws = Workspace(1 << 20)
    for group in groups.values():
        matvec.matvec_many([ref[i] for i in group], [weights[i] for i in group], x, [biases[i] for i in group],
                           stream, ws, quantized)  # fmt: skip
    q3, k3, v3 = (out.reshape(n, -1, head_dim) for out in ref)
    elementwise.rotary_store_kv(q3, k3, v3, positions, inv_freq, mscale, pairing, head_dim, ref_k, ref_v, slots,
                                stream)  # fmt: skip
    # Fused, as ops.qkv_rotary_store launches it: one launch per type, or one for all three where matvec.mixes them
    # (Q4_K q/k with Q6_K v at 4096 columns).
    got = [fresh((n, r), np.float32) for r in rows]
    got_k, got_v = fresh(cache_shape, np.float16), fresh(cache_shape, np.float16)
    mixed = matvec.mixes(tuple(int(t) for t in types), cols)
    assert mixed == (types == (Q.Q4_K, Q.Q4_K, Q.Q6_K) and cols % 2048 == 0)
    for group in [[0, 1, 2]] if mixed else groups.values():
        matvec.matvec_rope([got[i] for i in group], [weights[i] for i in group], tuple("qkv"[i] for i in group), x,
                           [biases[i] for i in group], positions, inv_freq, mscale, pairing, head_dim, got_k, got_v,
                           slots, stream, ws, quantized)  # fmt: skip
    assert ws.offset == 0
    stream.synchronize()
    for name, a, b in [("q", got[0], ref[0]), ("k", got[1], ref[1]), ("v", got[2], ref[2]),
                       ("k cache", got_k, ref_k), ("v cache", got_v, ref_v)]:  # fmt: skip
        a, b = a.to_host(), b.to_host()
        bits = np.uint32 if a.dtype == np.float32 else np.uint16
        differ = np.argwhere(a.view(bits) != b.view(bits))
        assert not len(differ), f"{name}: {len(differ)} elements differ, first at {differ[0].tolist()}"
        if name.endswith("cache"):
            flat = a.reshape(-1, kv_heads * head_dim)
            assert np.isfinite(flat[37]).all() and np.isnan(np.delete(flat, 37, axis=0)).all(), f"{name}: slots"
        else:
            assert np.isfinite(a).all(), f"{name}: unwritten rows"
    label = f"{pairing} {'+'.join(t.name for t in types)} n={n}{' deferred norm' if deferred else ''}"
    print(f"matvec_rope {label}: bitwise matvec_many + rotary_store_kv")


def test_matvec_rope_rejects_what_it_cannot_take(gpu):
    from infero.backends.cuda import matvec, runtime
    from infero.backends.cuda.tensor import Workspace, empty, from_host

    q, k = weight_case(Q.Q8_0, 128, 256)[0], weight_case(Q.Q8_0, 64, 256)[0]
    cache = empty((2, 16, 1, 64), np.float16)

    def call(n=1, roles=("q", "k"), head_dim=64, inv=32, pairing="neox", cache=cache):
        x, outs = empty((n, 256), np.float32), [empty((n, w.rows), np.float32) for w in (q, k)]
        positions, slots = from_host(np.zeros(n, np.int32)), from_host(np.zeros(n, np.int64))
        matvec.matvec_rope(outs, [q, k], roles, x, None, positions, empty((inv,), np.float32), 1.0, pairing,
                           head_dim, cache, cache, slots, runtime.stream(), Workspace(1 << 16))  # fmt: skip

    with pytest.raises(ValueError, match="at most 2"):
        call(n=3)
    with pytest.raises(ValueError, match="roles"):
        call(roles=("q", "x"))
    with pytest.raises(ValueError, match="whole heads"):
        call(head_dim=96, inv=48)
    with pytest.raises(ValueError, match="rotary over whole heads"):
        call(inv=16)
    with pytest.raises(ValueError, match="pairing"):
        call(pairing="gptj")
    with pytest.raises(ValueError, match="the k cache"):
        call(cache=empty((2, 16, 2, 64), np.float16))


def test_grouped_matvec_rejects_what_one_launch_cannot_take(gpu):
    from infero.backends.cuda import matvec, runtime
    from infero.backends.cuda.tensor import Workspace, empty

    q8, q4k, wide, f32 = (weight_case(Q.Q8_0, 64, 256)[0], weight_case(Q.Q4_K, 64, 256)[0],
                          weight_case(Q.Q8_0, 64, 512)[0], weight_case(Q.F32, 64, 256)[0])  # fmt: skip
    x = empty((2, 256), np.float32)

    def call(*weights):
        outs = [empty((2, w.rows), np.float32) for w in weights]
        matvec.matvec_many(outs, list(weights), x, None, runtime.stream(), Workspace(1 << 16))

    with pytest.raises(ValueError, match="one type and one width"):
        call(q8, q4k)
    with pytest.raises(ValueError, match="one type and one width"):
        call(q8, wide)
    with pytest.raises(ValueError, match="1 to 3"):
        call(q8, q8, q8, q8)
    with pytest.raises(ValueError, match="float weights"):
        call(f32, f32)


# Gate, up and SwiGLU of a decode step in one launch (matvec_glu): against the same math in float64 (x as the
# activation format gives it, gguf's weights; bound TIGHT as above: the SwiGLU of fp32 sums adds a few ulp), its
# quantized output bitwise numpy's quantization of its float output, two tokens bitwise one, and bitwise linears +
# swiglu (however the kernels split a row, its bits are unit_value.cuh's).
GLU_CASES = [(Q.Q4_K, 14336, 4096, False), (Q.Q4_K, 96, 768, True), (Q.Q6_K, 512, 2048, True)]


GLU_IDS = [f"{t.name}-{r}x{c}" for t, r, c, _ in GLU_CASES]


@pytest.mark.parametrize("qtype, rows, cols, with_bias", GLU_CASES, ids=GLU_IDS)
def test_matvec_glu_is_swiglu_of_gate_and_up(gpu, qtype, rows, cols, with_bias):
    from infero.backends.cuda import driver, elementwise, matvec, runtime
    from infero.backends.cuda.tensor import empty, from_host

    (gate, wg), (up, wu) = weight_case(qtype, rows, cols, seed=1), weight_case(qtype, rows, cols, seed=2)
    assert matvec.glu_fits(gate, up, 1) and matvec.glu_fits(gate, up, 2)
    rng = np.random.default_rng(rows + cols)
    biases = [rng.normal(0, 0.5, size=rows).astype(np.float32) if with_bias else None for _ in range(2)]
    x = (rng.normal(0, 1, size=(2, cols)) * rng.uniform(0.1, 10, size=(1, cols))).astype(np.float32)
    stream = runtime.stream()
    outs = {}
    for n in (1, 2):
        out = empty((n, rows), np.float32)
        driver.memset_d8(out.ptr, 0xFF, out.nbytes, stream)
        q_shape, s_shape = matvec.activation_shapes(n, cols)
        quantized = (empty(q_shape, np.int8), empty(s_shape, np.int32))
        matvec.quantize(*quantized, from_host(x[:n]), stream)
        y_shape, ys_shape = matvec.activation_shapes(n, rows)
        out_quantized = (empty(y_shape, np.int8), empty(ys_shape, np.int32))
        bd = tuple(from_host(b) if b is not None else None for b in biases)
        matvec.matvec_glu(out, gate, up, from_host(x[:n]), bd, quantized, out_quantized, stream)
        stream.synchronize()
        outs[n] = out.to_host()
        assert not np.isnan(outs[n]).any(), f"n={n}: {int(np.isnan(outs[n]).sum())} unwritten outputs"
        assert_quantized_like_numpy(*out_quantized, outs[n])
    assert np.array_equal(outs[2][:1].view(np.uint32), outs[1].view(np.uint32)), "token 0 of two differs from one"
    xhat = quantize_like_kernel(x)[3]
    g, u = (xhat @ w.T + (b if b is not None else 0) for w, b in ((wg, biases[0]), (wu, biases[1])))
    ref = g / (1 + np.exp(-g)) * u
    err = rel_err(outs[2], ref)
    print(f"matvec_glu {qtype.name} {rows}x{cols}: {describe(outs[2], ref)}")
    assert err < TIGHT, describe(outs[2], ref)
    lin_g, lin_u = run_matvec_many([gate, up], x, biases)
    out2 = empty((2, rows), np.float32)
    elementwise.swiglu(out2, from_host(lin_g), from_host(lin_u), stream)
    stream.synchronize()
    assert not bitwise_failures("matvec_glu against linears + swiglu", outs[2], out2.to_host())


def test_matvec_glu_rejects_what_it_cannot_take(gpu):
    from infero.backends.cuda import matvec
    from infero.backends.cuda.tensor import empty

    gate, up = weight_case(Q.Q4_K, 64, 256)[0], weight_case(Q.Q4_K, 64, 256, seed=1)[0]
    assert not matvec.glu_fits(gate, up, 3)  # one or two tokens
    assert not matvec.glu_fits(gate, weight_case(Q.Q4_K, 32, 256)[0], 1)  # the same shapes
    assert not matvec.glu_fits(weight_case(Q.Q4_K, 48, 256)[0], weight_case(Q.Q4_K, 48, 256)[0], 1)  # whole groups
    assert not matvec.glu_fits(weight_case(Q.Q8_0, 64, 256)[0], weight_case(Q.Q8_0, 64, 256)[0], 1)  # tensor cores
    x = empty((3, 256), np.float32)
    q = tuple(empty(s, d) for s, d in zip(matvec.activation_shapes(3, 256), (np.int8, np.int32), strict=True))
    y = tuple(empty(s, d) for s, d in zip(matvec.activation_shapes(3, 64), (np.int8, np.int32), strict=True))
    with pytest.raises(ValueError, match="glu_fits"):
        matvec.matvec_glu(empty((3, 64), np.float32), gate, up, x, (None, None), q, y, None)


# A decode step's linear layer into the residual stream with the next RMSNorm deferred to its readers (matvec_norm),
# and those readers. The producer: its residual bitwise the plain mat-vec's output added to the residual (both
# unit_value.cuh's row), its activation bitwise numpy's quantization of residual * norm weight, each group's sum of
# squares bitwise the kernel's butterfly, two tokens bitwise one. The readers (matvec_mma, matvec_mma_glu; matvec_rope
# above): against float64 with the activation as the format gives it, times 1 / rms in float64 (bound TIGHT: the
# factor is fp32 from fp32 sums), and within INT8_BOUND of the exact norm (two planes' rounding).
NORM_CASES = [(Q.Q4_K, 4096, 4096), (Q.Q4_K, 256, 8192), (Q.Q6_K, 512, 2048), (Q.Q4_K, 96, 768)]


def butterfly_sum(v: np.ndarray) -> np.ndarray:
    """Sum over the last axis (32 lanes) by a float32 xor butterfly, offsets 16 to 1: what every lane ends with."""
    v = v.astype(np.float32)
    lanes = np.arange(32)
    for o in (16, 8, 4, 2, 1):
        v = (v + v[..., lanes ^ o]).astype(np.float32)
    return v[..., 0]


def deferred_activation(r: np.ndarray, norm_weight: np.ndarray, eps: float):
    """(matvec.Activation of the residual r [n, cols] with its RMSNorm deferred, as matvec_norm writes it; the float64
    values a reader computes with: the format's values of r * norm_weight, times 1 / rms(r))."""
    from infero.backends.cuda import driver, matvec, runtime
    from infero.backends.cuda.tensor import from_host

    n, cols = r.shape
    y = (r * norm_weight).astype(np.float32)
    xq, xs, norm_ss = deferred_buffers(n, cols)
    matvec.quantize(xq, xs, from_host(y), runtime.stream())
    sums = butterfly_sum((r * r).astype(np.float32).reshape(n, cols // 32, 32))
    driver.copy_host_to_device(norm_ss.ptr, np.ascontiguousarray(sums))
    inv_rms = 1 / np.sqrt(np.mean(r.astype(np.float64) ** 2, axis=-1, keepdims=True) + eps)
    return matvec.Activation(xq, xs, norm_ss, eps), quantize_like_kernel(y)[3] * inv_rms


def deferred_buffers(n: int, cols: int):
    """q, s and norm_ss of an activation with a deferred norm: norm_ss right after s (matvec.Activation)."""
    from infero.backends.cuda import matvec
    from infero.backends.cuda.tensor import DeviceTensor, empty

    q_shape, s_shape = matvec.activation_shapes(n, cols)
    s_and_sums = empty((int(np.prod(s_shape)) + n * cols // 32,), np.int32)
    xs = DeviceTensor(s_and_sums.ptr, s_shape, np.dtype(np.int32), s_and_sums)
    norm_ss = DeviceTensor(xs.ptr + xs.nbytes, (n, cols // 32), np.dtype(np.float32), s_and_sums)
    return empty(q_shape, np.int8), xs, norm_ss


@pytest.mark.parametrize("qtype, rows, cols", NORM_CASES, ids=[f"{t.name}-{r}x{c}" for t, r, c in NORM_CASES])
def test_matvec_norm_adds_into_the_residual_and_writes_the_readers_activation(gpu, qtype, rows, cols):
    from infero.backends.cuda import driver, matvec, runtime
    from infero.backends.cuda.tensor import empty, from_host

    weight, w = weight_case(qtype, rows, cols)
    assert matvec.norm_fits(weight, 1) and matvec.norm_fits(weight, 2)
    rng = np.random.default_rng(rows + 3 * cols)
    x = (rng.normal(0, 1, size=(2, cols)) * rng.uniform(0.1, 10, size=(1, cols))).astype(np.float32)
    residual0 = rng.normal(0, 3, size=(2, rows)).astype(np.float32)
    norm_weight = rng.uniform(0.2, 2, size=rows).astype(np.float32)
    stream = runtime.stream()
    results = {}
    for n in (1, 2):
        residual = from_host(residual0[:n])
        q_shape, s_shape = matvec.activation_shapes(n, cols)
        quantized = (empty(q_shape, np.int8), empty(s_shape, np.int32))
        matvec.quantize(*quantized, from_host(x[:n]), stream)
        out = matvec.Activation(*deferred_buffers(n, rows), 1e-5)
        driver.memset_d8(out.norm_ss.ptr, 0xFF, out.norm_ss.nbytes, stream)
        matvec.matvec_norm(residual, weight, from_host(x[:n]), quantized, from_host(norm_weight), out, stream)
        stream.synchronize()
        r = residual.to_host()
        expected = (residual0[:n] + run_matvec(weight, x[:n], None)).astype(np.float32)
        differ = np.argwhere(r.view(np.uint32) != expected.view(np.uint32))
        assert not len(differ), (
            f"n={n}: {len(differ)} residual elements differ from the plain mat-vec's, first at {differ[0].tolist()}"
        )
        assert_quantized_like_numpy(out.q, out.s, (r * norm_weight).astype(np.float32))
        sums = butterfly_sum((r * r).astype(np.float32).reshape(n, rows // 32, 32))
        assert np.array_equal(out.norm_ss.to_host().view(np.uint32), sums.view(np.uint32)), f"n={n}: sums of squares"
        results[n] = (r, out.q.to_host(), out.s.to_host(), out.norm_ss.to_host())
    r1, q1, s1, ss1 = results[1]
    r2, q2, s2, ss2 = results[2]
    assert np.array_equal(r2[:1].view(np.uint32), r1.view(np.uint32)), "token 0 of two differs from one"
    assert np.array_equal(q2[:, :1], q1) and np.array_equal(s2[:1], s1) and np.array_equal(ss2[:1], ss1)
    ref = residual0.astype(np.float64) + quantize_like_kernel(x)[3] @ w.T
    print(f"matvec_norm {qtype.name} {rows}x{cols}: residual {describe(r2, ref)}")


READER_CASES = [(Q.Q4_K, 1024, 4096), (Q.Q6_K, 2048, 2048), (Q.Q4_K, 64, 256)]


@pytest.mark.parametrize("qtype, rows, cols", READER_CASES, ids=[f"{t.name}-{r}x{c}" for t, r, c in READER_CASES])
def test_the_readers_of_a_deferred_norm_apply_it(gpu, qtype, rows, cols):
    from infero.backends.cuda import driver, matvec, runtime
    from infero.backends.cuda.tensor import Workspace, empty

    (weight, w), (up, wu) = weight_case(qtype, rows, cols, seed=3), weight_case(qtype, rows, cols, seed=4)
    rng = np.random.default_rng(rows * cols)
    r = (rng.normal(0, 1, size=(16, cols)) * rng.uniform(0.1, 30, size=(1, cols))).astype(np.float32)
    norm_weight = rng.uniform(0.2, 2, size=cols).astype(np.float32)
    exact = r / np.sqrt(np.mean(r.astype(np.float64) ** 2, axis=-1, keepdims=True) + 1e-5) * norm_weight
    stream = runtime.stream()
    for n in (1, 2):
        act, xhat = deferred_activation(r[:n], norm_weight, 1e-5)
        out = empty((n, rows), np.float32)
        driver.memset_d8(out.ptr, 0xFF, out.nbytes, stream)
        matvec.matvec(out, weight, empty((n, cols), np.float32), None, stream, Workspace(1 << 16), act)
        glu = empty((n, rows), np.float32)
        driver.memset_d8(glu.ptr, 0xFF, glu.nbytes, stream)
        y_shape, ys_shape = matvec.activation_shapes(n, rows)
        glu_q = (empty(y_shape, np.int8), empty(ys_shape, np.int32))
        matvec.matvec_glu(glu, weight, up, empty((n, cols), np.float32), (None, None), act, glu_q, stream)
        stream.synchronize()
        g, u = xhat @ w.T, xhat @ wu.T
        for name, got, ref, exact_ref in [("matvec", out.to_host(), g, exact[:n] @ w.T),
                                          ("matvec_glu", glu.to_host(), g / (1 + np.exp(-g)) * u,
                                           None)]:  # fmt: skip
            print(f"{name} {qtype.name} {rows}x{cols} n={n}: {describe(got, ref)}")
            assert rel_err(got, ref) < TIGHT, f"{name} n={n}: {describe(got, ref)}"
            if exact_ref is not None:
                assert rel_err(got, exact_ref) < INT8_BOUND, f"{name} n={n} against the exact norm"


def test_matvec_norm_and_its_readers_reject_what_they_cannot_take(gpu):
    from infero.backends.cuda import matvec, runtime
    from infero.backends.cuda.tensor import Workspace, empty

    weight = weight_case(Q.Q4_K, 64, 256)[0]
    assert not matvec.norm_fits(weight, 3)  # one or two tokens
    assert not matvec.norm_fits(weight_case(Q.Q4_K, 48, 256)[0], 1)  # whole groups of 32 rows
    assert not matvec.norm_fits(weight_case(Q.Q8_0, 64, 256)[0], 1)  # the tensor cores
    assert not matvec.norm_fits(weight_case(Q.Q4_K, 8192 + 32, 256)[0], 1)  # rows its readers take
    x = empty((3, 256), np.float32)
    q = tuple(empty(s, d) for s, d in zip(matvec.activation_shapes(3, 256), (np.int8, np.int32), strict=True))
    y = matvec.Activation(*deferred_buffers(3, 64), 1e-5)
    with pytest.raises(ValueError, match="norm_fits"):
        matvec.matvec_norm(empty((3, 64), np.float32), weight, x, q, empty((64,), np.float32), y, None)
    rng = np.random.default_rng(0)
    act = deferred_activation(rng.normal(size=(1, 256)).astype(np.float32), np.ones(256, np.float32), 1e-5)[0]
    q8 = weight_case(Q.Q8_0, 64, 256)[0]
    with pytest.raises(ValueError, match="deferred RMSNorm"):
        matvec.matvec(empty((1, 64), np.float32), q8, empty((1, 256), np.float32), None, runtime.stream(),
                      Workspace(1 << 16), act)  # fmt: skip
