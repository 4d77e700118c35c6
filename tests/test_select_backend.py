"""Which backend runs a model: the hybrid architectures, which the GPU does not run yet, and head dims its attention
kernels are not built for stay on the CPU."""

import pytest

from infero.backends import select_backend
from infero.backends.cpu import CpuBackend
from infero.errors import UnsupportedModelError


@pytest.mark.parametrize("architecture", ["qwen35", "qwen35moe", "qwen3next"])
def test_auto_runs_a_cpu_only_architecture_on_the_cpu_with_a_note(capsys, architecture):
    assert isinstance(select_backend("auto", architecture), CpuBackend)
    assert (
        capsys.readouterr().err == f"infero: {architecture} runs on the CPU backend only for now; running on the CPU\n"
    )


@pytest.mark.parametrize("architecture", ["qwen35", "qwen35moe", "qwen3next"])
def test_cuda_refuses_a_hybrid_architecture_in_one_line(architecture):
    with pytest.raises(
        UnsupportedModelError, match=f"^{architecture} runs on the CPU backend only for now: use --device cpu$"
    ):
        select_backend("cuda", architecture)


def test_auto_does_not_steer_qwen3moe_to_the_cpu(capsys):
    """qwen3moe runs on the GPU backend: auto takes the GPU where there is one (here, without one, the CPU with the
    no-GPU note, never the CPU-only one)."""
    select_backend("auto", "qwen3moe")
    assert "runs on the CPU backend only" not in capsys.readouterr().err


def test_a_head_dim_the_gpu_attention_lacks_runs_on_the_cpu_with_auto_and_is_refused_with_cuda(capsys):
    assert isinstance(select_backend("auto", "qwen3moe", 16), CpuBackend)
    note = (
        "infero: attention heads of 16 run on the CPU backend only (the GPU's take 64, 128 or 256); running on the "
        "CPU\n"
    )
    assert capsys.readouterr().err == note
    refusal = "^attention heads of 96 run on the CPU backend only .*: use --device cpu$"
    with pytest.raises(UnsupportedModelError, match=refusal):
        select_backend("cuda", "llama", 96)


def test_auto_does_not_steer_head_dim_256_to_the_cpu(capsys):
    """Qwen3.5 / Qwen3-Next's gated attention layers have heads of 256, which the GPU's attention kernels take."""
    select_backend("auto", "qwen3moe", 256)
    assert "run on the CPU backend only" not in capsys.readouterr().err


def test_the_gpu_head_dims_are_the_attention_kernels():
    from infero.backends import GPU_HEAD_DIMS
    from infero.backends.cuda import attention

    assert GPU_HEAD_DIMS == attention.HEAD_DIMS
