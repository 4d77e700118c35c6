"""Backends: where a model's ops run. `cpu` (numpy) exists everywhere; `cuda` arrives with its kernels."""

from __future__ import annotations

import sys

from infero.errors import InferoError, UnsupportedModelError

DEVICES = ("auto", "cpu", "cuda")
# The head dims the GPU's attention kernels are built for (cuda/attention.py HEAD_DIMS; a test keeps the two equal).
GPU_HEAD_DIMS = (64, 128, 256)


def select_backend(device: str = "auto", head_dim: int | None = None):
    """The backend for --device; `auto` takes the GPU when infero can drive one and runs the model (its attention's
    head dim), else the CPU (with a note). Every architecture runs on both backends."""
    if device not in DEVICES:
        raise InferoError(f"unknown device {device!r} (choose from {', '.join(DEVICES)})")
    reason = None
    if head_dim is not None and head_dim not in GPU_HEAD_DIMS:
        dims = ", ".join(str(d) for d in GPU_HEAD_DIMS[:-1]) + f" or {GPU_HEAD_DIMS[-1]}"
        reason = f"attention heads of {head_dim} run on the CPU backend only (the GPU's take {dims})"
    if reason is not None:
        if device == "cuda":
            raise UnsupportedModelError(f"{reason}: use --device cpu")
        if device == "auto":
            print(f"infero: {reason}; running on the CPU", file=sys.stderr)
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
