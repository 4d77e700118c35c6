"""The feed-forward block of one decode token in one launch (matvec.feed_forward, kernels/matvec.cu matvec_mlp).

1. Bitwise the launches it replaces: matvec_many over gate and up, swiglu writing the activation format, matvec
   over down (those are checked against numpy in test_matvec.py and test_elementwise.py).
2. Within the activation format's error of numpy on gguf's dequantized weights: down @ (silu(gate x) * (up x)) in
   float64 with x and h as the kernel quantizes them (bound 1e-3, as test_matvec.py's).
3. Launched again with the same barrier counters, it gives the same bits: the kernel leaves them zero.
The output is poisoned with NaN before every launch, so a row the kernel never writes shows.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from test_matvec import INT8_BOUND, describe, quantize_like_kernel, rel_err, weight_case

pytestmark = pytest.mark.gpu

# (gate/up type, down type, hidden, intermediate): llama-3.1-8b Q4_K_M's layers with a Q6_K and with a Q4_K down
# projection, qwen2.5-0.5b Q8_0 (896 columns: 28 of 32 lanes busy), SmolLM2-135M Q4_1 (fewer rows than warps).
CASES = [
    (Q.Q4_K, Q.Q6_K, 4096, 14336),
    (Q.Q4_K, Q.Q4_K, 4096, 14336),
    (Q.Q8_0, Q.Q8_0, 896, 4864),
    (Q.Q4_1, Q.Q4_1, 576, 1536),
]


def activation_buffers(cols: int):
    """(xq int8, xs int32) for one token of `cols` in the mat-vec's activation format."""
    from infero.backends.cuda import matvec
    from infero.backends.cuda.tensor import empty

    q_shape, s_shape = matvec.activation_shapes(1, cols)
    return empty(q_shape, np.int8), empty(s_shape, np.int32)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0].name}-{c[1].name}-{c[2]}x{c[3]}")
def test_feed_forward_is_the_separate_launches_bitwise(gpu, case):
    from infero.backends.cuda import driver, elementwise, matvec, runtime
    from infero.backends.cuda.tensor import Workspace, empty, from_host

    tg, td, hidden, inter = case
    gate, wg = weight_case(tg, inter, hidden, 1)
    up, wu = weight_case(tg, inter, hidden, 2)
    down, wd = weight_case(td, hidden, inter, 3)
    assert matvec.feed_forward_fits(gate, up, down)
    stream = runtime.stream()
    x = np.random.default_rng(hidden + inter).normal(0, 1, size=(1, hidden)).astype(np.float32)
    xd = from_host(x)
    ws = Workspace(64 * inter + (1 << 16))
    xq, xs = activation_buffers(hidden)
    matvec.quantize(xq, xs, xd, stream)

    g, u, h = (empty((1, inter), np.float32) for _ in range(3))
    hq, hs = activation_buffers(inter)
    matvec.matvec_many([g, u], [gate, up], xd, None, stream, ws, (xq, xs))
    elementwise.swiglu(h, g, u, stream, (hq, hs))
    separate = empty((1, hidden), np.float32)
    matvec.matvec(separate, down, h, None, stream, ws, (hq, hs))
    stream.synchronize()
    expected = separate.to_host()

    barrier = from_host(np.zeros(2, np.uint32))
    for launch in range(2):
        out = empty((1, hidden), np.float32)
        driver.memset_d8(out.ptr, 0xFF, out.nbytes, stream)
        matvec.feed_forward(out, gate, up, down, (xq, xs), barrier, stream, ws)
        assert ws.offset == 0, "feed_forward must hand its scratch back"
        stream.synchronize()
        fused = out.to_host()
        differ = np.flatnonzero(fused.view(np.uint32) != expected.view(np.uint32))
        assert differ.size == 0, (
            f"launch {launch}: {differ.size} of {hidden} rows differ from the separate launches, first row "
            f"{differ[0]}: {fused[0, differ[0]]!r} vs {expected[0, differ[0]]!r}"
        )
        assert (barrier.to_host() == 0).all(), f"launch {launch} left the barrier at {barrier.to_host()}"

    _, _, _, xhat = quantize_like_kernel(x)
    gr, ur = wg @ xhat[0], wu @ xhat[0]
    hr = (gr / (1 + np.exp(-gr)) * ur).astype(np.float32)[None]
    reference = wd @ quantize_like_kernel(hr)[3][0]
    assert rel_err(fused[0], reference) < INT8_BOUND, describe(fused, reference[None])


def test_feed_forward_rejects_what_it_cannot_fuse(gpu):
    from infero.backends.cuda import matvec, runtime
    from infero.backends.cuda.tensor import Workspace, empty, from_host

    gate, _ = weight_case(Q.Q4_K, 1536, 512, 1)
    up, _ = weight_case(Q.Q8_0, 1536, 512, 2)  # gate and up of different types
    down, _ = weight_case(Q.Q4_K, 512, 1536, 3)
    assert not matvec.feed_forward_fits(gate, up, down)
    xq, xs = activation_buffers(512)
    with pytest.raises(ValueError, match="do not fit one fused launch"):
        matvec.feed_forward(empty((1, 512), np.float32), gate, up, down, (xq, xs), from_host(np.zeros(2, np.uint32)),
                            runtime.stream(), Workspace(1 << 20))  # fmt: skip
