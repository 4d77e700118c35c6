"""Backends: where a model's ops run. `cpu` (numpy) exists everywhere; `cuda` arrives with its kernels."""

from __future__ import annotations

from infero.errors import InferoError

DEVICES = ("auto", "cpu", "cuda")


def select_backend(device: str = "auto"):
    """The backend for --device; `auto` takes the GPU when infero can drive one, else the CPU."""
    if device not in DEVICES:
        raise InferoError(f"unknown device {device!r} (choose from {', '.join(DEVICES)})")
    if device == "cuda":
        raise InferoError("--device cuda: this build of infero has no CUDA backend yet; use --device cpu")
    from infero.backends.cpu import CpuBackend

    return CpuBackend()
