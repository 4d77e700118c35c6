"""A layer whose norm the decode step folds into its projection (matvec_norm: the readers apply 1 / rms) keeps that
deferred form at every token count: add_rms_norm writes it where matvec_norm does not run (three tokens and more,
the GEMM's widths), and must write the same bits, so that a reader's output does not depend on the step's width
(docs/kernels.md, batch invariance)."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from test_matvec import butterfly_sum, deferred_buffers, run_matvec, weight_case

pytestmark = pytest.mark.gpu

CASES = [(Q.Q4_K, 1024, 4096), (Q.Q6_K, 2048, 2048)]


@pytest.mark.parametrize("qtype, rows, cols", CASES, ids=[f"{t.name}-{r}x{c}" for t, r, c in CASES])
def test_add_rms_norm_writes_the_deferred_form_matvec_norm_writes(gpu, qtype, rows, cols):
    from infero.backends.cuda import driver, elementwise, matvec, runtime
    from infero.backends.cuda.tensor import empty, from_host

    weight, _ = weight_case(qtype, rows, cols)
    rng = np.random.default_rng(rows + cols)
    x = (rng.normal(0, 1, size=(40, cols)) * rng.uniform(0.1, 10, size=(1, cols))).astype(np.float32)
    residual0 = rng.normal(0, 3, size=(40, rows)).astype(np.float32)
    norm_weight = from_host(rng.uniform(0.2, 2, size=rows).astype(np.float32))
    stream = runtime.stream()

    def deferred(n):
        act = matvec.Activation(*deferred_buffers(n, rows), 1e-5)
        driver.memset_d8(act.norm_ss.ptr, 0xFF, act.norm_ss.nbytes, stream)
        return act

    folded = []
    for t in range(2):  # matvec_norm at one token, each row of the 40 as its own decode step
        residual = from_host(residual0[t : t + 1])
        q_shape, s_shape = matvec.activation_shapes(1, cols)
        quantized = (empty(q_shape, np.int8), empty(s_shape, np.int32))
        matvec.quantize(*quantized, from_host(x[t : t + 1]), stream)
        act = deferred(1)
        matvec.matvec_norm(residual, weight, from_host(x[t : t + 1]), quantized, norm_weight, act, stream)
        stream.synchronize()
        folded.append((residual.to_host(), act.q.to_host(), act.s.to_host(), act.norm_ss.to_host()))

    for n in (1, 3, 16, 40):
        residual = from_host(residual0[:n])
        y = from_host(run_matvec(weight, x[:n], None) if n <= 16 else np.concatenate(
            [run_matvec(weight, x[a : a + 16], None) for a in range(0, n, 16)]))  # fmt: skip
        out, act = empty((n, rows), np.float32), deferred(n)
        elementwise.add_rms_norm(out, residual, y, norm_weight, 1e-5, stream, act)
        stream.synchronize()
        r, q, s, ss = residual.to_host(), act.q.to_host(), act.s.to_host(), act.norm_ss.to_host()
        assert np.array_equal(ss.view(np.uint32), butterfly_sum((r * r).reshape(n, rows // 32, 32)).view(np.uint32))
        for t in range(min(n, 2)):
            fr, fq, fs, fss = folded[t]
            assert np.array_equal(r[t : t + 1].view(np.uint32), fr.view(np.uint32)), f"n={n} row {t}: residual"
            assert np.array_equal(q[:, t : t + 1], fq), f"n={n} row {t}: planes"
            assert np.array_equal(s[t : t + 1], fs), f"n={n} row {t}: scales and sums"
            assert np.array_equal(ss[t : t + 1].view(np.uint32), fss.view(np.uint32)), f"n={n} row {t}: squares"
