"""GPU tests: run on a machine with an NVIDIA GPU, skip with the reason everywhere else."""

import numpy as np
import pytest


def _gpu_or_reason():
    try:
        from infero.backends.cuda import runtime

        return runtime.context(), None
    except Exception as e:  # no driver, no GPU, no cuda-bindings
        return None, f"no CUDA GPU: {type(e).__name__}: {e}"


@pytest.fixture(scope="session")
def gpu():
    ctx, reason = _gpu_or_reason()
    if ctx is None:
        pytest.skip(reason)
    return ctx


def rel_err(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))
