"""Which backend runs a model: the hybrid architectures, which the GPU does not run yet, stay on the CPU."""

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
