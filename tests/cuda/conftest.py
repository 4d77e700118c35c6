"""GPU tests: run on a machine with an NVIDIA GPU, skip with the reason everywhere else."""

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
