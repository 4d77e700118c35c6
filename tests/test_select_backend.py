"""Which backend runs a model: the GPU where there is one, except for head dims its attention kernels are not built
for, which stay on the CPU."""

import pytest

from infero.backends import select_backend
from infero.backends.cpu import CpuBackend
from infero.errors import UnsupportedModelError


def test_a_head_dim_the_gpu_attention_lacks_runs_on_the_cpu_with_auto_and_is_refused_with_cuda(capsys):
    assert isinstance(select_backend("auto", 16), CpuBackend)
    note = (
        "infero: attention heads of 16 run on the CPU backend only (the GPU's take 64, 128 or 256); running on the "
        "CPU\n"
    )
    assert capsys.readouterr().err == note
    refusal = "^attention heads of 96 run on the CPU backend only .*: use --device cpu$"
    with pytest.raises(UnsupportedModelError, match=refusal):
        select_backend("cuda", 96)


def test_auto_does_not_steer_head_dim_256_to_the_cpu(capsys):
    """Qwen3.5 / Qwen3-Next's gated attention layers have heads of 256, which the GPU's attention kernels take."""
    select_backend("auto", 256)
    assert "run on the CPU backend only" not in capsys.readouterr().err


def test_the_gpu_head_dims_are_the_attention_kernels():
    from infero.backends import GPU_HEAD_DIMS
    from infero.backends.cuda import attention

    assert GPU_HEAD_DIMS == attention.HEAD_DIMS
