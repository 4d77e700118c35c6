"""Model families, chosen by the checkpoint's architecture name."""

from __future__ import annotations

import importlib
from typing import Any

from infero.checkpoint import Checkpoint
from infero.errors import UnsupportedModelError

# architecture name -> module.class, imported when first used; llama, mistral, qwen2 and qwen3 differ only in flags
# of one decoder.
_REGISTRY = {"llama": "llama.LlamaModel", "mistral": "llama.LlamaModel", "qwen2": "llama.LlamaModel",
             "qwen3": "llama.LlamaModel", "qwen3moe": "qwen3moe.Qwen3MoeModel", "qwen35": "qwen35.Qwen35Model",
             "qwen35moe": "qwen35.Qwen35Model", "qwen3next": "qwen35.Qwen35Model"}  # fmt: skip


def load_model(checkpoint: Checkpoint, ops: Any, progress=None):
    arch = checkpoint.config.architecture
    if arch not in _REGISTRY:
        raise UnsupportedModelError(f"no model family for architecture {arch!r}")
    module, name = _REGISTRY[arch].rsplit(".", 1)
    return getattr(importlib.import_module(f"infero.models.{module}"), name).load(checkpoint, ops, progress)
