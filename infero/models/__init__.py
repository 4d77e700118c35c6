"""Model families, chosen by the checkpoint's architecture name."""

from __future__ import annotations

from typing import Any

from infero.checkpoint import Checkpoint
from infero.errors import UnsupportedModelError

# architecture name -> model class; llama, mistral, qwen2 and qwen3 differ only in flags of one decoder.
_REGISTRY = {"llama": "llama", "mistral": "llama", "qwen2": "llama", "qwen3": "llama"}


def load_model(checkpoint: Checkpoint, ops: Any, progress=None):
    arch = checkpoint.config.architecture
    if arch not in _REGISTRY:
        raise UnsupportedModelError(f"no model family for architecture {arch!r}")
    from infero.models.llama import LlamaModel

    return LlamaModel.load(checkpoint, ops, progress)
