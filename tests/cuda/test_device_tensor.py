"""DeviceTensor's shape arithmetic and the workspace's carving (no GPU: device memory as made-up addresses)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from infero.backends.cuda import tensor
from infero.backends.cuda.tensor import DeviceTensor


def test_numel_nbytes_and_reshape_follow_the_shape():
    t = DeviceTensor(1 << 20, (3, 4, 5), np.dtype(np.float32))
    assert (t.numel, t.nbytes) == (60, 240)
    assert DeviceTensor(1 << 20, (), np.dtype(np.int32)).numel == 1
    assert DeviceTensor(1 << 20, (0, 7), np.dtype(np.int8)).numel == 0
    assert DeviceTensor(1 << 20, (np.int64(6), 2), np.dtype(np.float16)).nbytes == 24  # numpy ints in a shape
    assert t.reshape(12, -1).shape == (12, 5) and t.reshape((60,)).shape == (60,) and t.reshape(-1, 2, 3).shape == (
        10, 2, 3)  # fmt: skip
    assert isinstance(t.numel, int) and isinstance(t.reshape(-1).shape[0], int)
    with pytest.raises(ValueError, match="cannot reshape"):
        t.reshape(7, 9)
    rows = t.rows(1, 3)
    assert rows.ptr == t.ptr + 80 and rows.shape == (2, 4, 5)


def test_the_workspace_carves_aligned_tensors_and_refuses_past_its_end(monkeypatch):
    from infero.backends.cuda import driver

    monkeypatch.setattr(driver, "DeviceMemory", lambda nbytes: SimpleNamespace(ptr=1 << 30, nbytes=nbytes))
    ws = tensor.Workspace(4096)
    a = ws.empty((3, 5), np.float32)
    b = ws.empty((10,), np.int8)
    assert (a.ptr, a.shape, b.ptr) == (1 << 30, (3, 5), (1 << 30) + tensor.Workspace.ALIGN)
    assert ws.offset == 2 * tensor.Workspace.ALIGN
    with pytest.raises(MemoryError, match="exhausted"):
        ws.empty((1024,), np.float32)
