"""ops.linears, the model's call for the linear layers that read one input (q/k/v, gate/up): the same outputs as
one linear call per layer."""

import numpy as np

from infero.backends.cpu.ops import CpuOps


def test_cpu_linears_equal_separate_linear_calls():
    ops = CpuOps()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(5, 64)).astype(np.float32)
    weights = [rng.normal(size=(rows, 64)).astype(np.float32) for rows in (64, 16, 16)]
    biases = [rng.normal(size=64).astype(np.float32), None, rng.normal(size=16).astype(np.float32)]
    for bias_list in (biases, None):
        got = ops.linears(x, weights, bias_list)
        want = [ops.linear(x, w, b) for w, b in zip(weights, bias_list or (None,) * 3, strict=True)]
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            assert g.shape == w.shape and np.array_equal(g, w)
