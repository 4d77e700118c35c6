"""Backends: where a model's ops run. `cpu` (numpy) exists everywhere; `cuda` arrives with its kernels."""

from __future__ import annotations

import sys

from infero.errors import InferoError, UnsupportedModelError

DEVICES = ("auto", "cpu", "cuda")
# Architectures whose ops only the CPU backend implements (the Qwen3.5 hybrids: the GPU's Gated DeltaNet kernels and
# recurrent-state cache are not written yet).
CPU_ONLY_ARCHITECTURES = ("qwen35", "qwen35moe", "qwen3next")


def select_backend(device: str = "auto", architecture: str | None = None):
    """The backend for --device; `auto` takes the GPU when infero can drive one and runs the architecture, else the
    CPU (with a note)."""
    if device not in DEVICES:
        raise InferoError(f"unknown device {device!r} (choose from {', '.join(DEVICES)})")
    if architecture in CPU_ONLY_ARCHITECTURES:
        if device == "cuda":
            raise UnsupportedModelError(f"{architecture} runs on the CPU backend only for now: use --device cpu")
        if device == "auto":
            print(f"infero: {architecture} runs on the CPU backend only for now; running on the CPU", file=sys.stderr)
            device = "cpu"
    if device in ("auto", "cuda"):
        try:
            from infero.backends.cuda import CudaBackend

            return CudaBackend()
        except Exception as e:  # no driver, no GPU, or no cuda-bindings: only fatal when the GPU was asked for
            if device == "cuda":
                raise InferoError(f"--device cuda: {e}") from None
            print(f"infero: no usable GPU ({e}); running on the CPU", file=sys.stderr)
    from infero.backends.cpu import CpuBackend

    return CpuBackend()
