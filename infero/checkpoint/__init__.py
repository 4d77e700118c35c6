"""Checkpoints on disk -> a ModelConfig and named tensors in their stored encoding (memory-mapped)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infero.checkpoint.config import ModelConfig
from infero.checkpoint.gguf import GGUFModel, TensorInfo
from infero.checkpoint.shapes import check_tensor_shapes


@dataclass
class Checkpoint:
    path: Path
    config: ModelConfig
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]
    file_size: int

    @property
    def quantization(self) -> str:
        """The type most of the weight bytes are stored in (e.g. Q4_1), as a one-word summary."""
        by_type: dict[str, int] = {}
        for t in self.tensors.values():
            if len(t.shape) > 1:
                by_type[t.type_name] = by_type.get(t.type_name, 0) + t.nbytes
        return max(by_type, key=by_type.get) if by_type else "none"


def load_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Open a GGUF model (one file or the first of a split set) without reading its tensor data."""
    path = Path(path)
    model = GGUFModel.open(path)
    config = ModelConfig.from_gguf(model.metadata, set(model.tensors))
    check_tensor_shapes(path, config, model.tensors)
    return Checkpoint(path, config, model.metadata, model.tensors, model.file_size)
