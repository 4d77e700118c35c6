"""Decode a stored tensor to float32 on the host, with the `gguf` package's reference dequantizers."""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from infero.checkpoint.gguf import TensorInfo
from infero.checkpoint.tensor_types import SUPPORTED_TYPES, GGMLType
from infero.errors import UnsupportedModelError


def dequantize_tensor(tensor: TensorInfo) -> np.ndarray:
    """The tensor as a new float32 array in its numpy shape."""
    if tensor.ggml_type not in SUPPORTED_TYPES:
        raise UnsupportedModelError(f"tensor {tensor.name!r} has type {tensor.type_name}, which infero does not run")
    if tensor.ggml_type == GGMLType.F32:
        return tensor.data.view(np.float32).reshape(tensor.shape).copy()
    num_rows = int(np.prod(tensor.shape[:-1], dtype=np.int64)) if len(tensor.shape) > 1 else 1
    rows = tensor.data.reshape(num_rows, -1)
    out = dequantize(rows, GGMLQuantizationType(tensor.ggml_type))
    return np.ascontiguousarray(out, dtype=np.float32).reshape(tensor.shape)
