"""CudaOps.stacked_weight: an expert tensor and one more expert after it (Qwen3.5-MoE's folded shared expert) land
in one allocation, part after part, laid out as moe.upload lays out one expert tensor; no host copy of the whole.
Runs without a GPU (the copies are recorded)."""

from types import SimpleNamespace

import numpy as np
from gguf import GGMLQuantizationType as Q

from infero.backends.cuda import driver, moe
from infero.backends.cuda.ops import CudaOps
from infero.checkpoint.gguf import TensorInfo


class Arena:
    def __init__(self):
        self.next = 1 << 20

    def allocate(self, nbytes: int) -> int:
        ptr, self.next = self.next, self.next + -(-nbytes // 256) * 256
        return ptr


def test_a_shared_expert_stacked_after_the_experts_is_copied_into_the_next_experts_rows(monkeypatch):
    copies = []
    monkeypatch.setattr(driver, "copy_host_to_device", lambda dst, src, stream=None: copies.append((dst, src)))
    ops = CudaOps(SimpleNamespace(weights_arena=Arena()))
    row_bytes = 64 // 32 * 34  # Q8_0: 34 bytes a block of 32
    rng = np.random.default_rng(0)
    experts = TensorInfo("e", int(Q.Q8_0), (4, 6, 64), rng.integers(0, 255, 4 * 6 * row_bytes, np.uint8))
    shared = TensorInfo("s", int(Q.Q8_0), (6, 64), rng.integers(0, 255, 6 * row_bytes, np.uint8))
    w = ops.stacked_weight([experts, shared], (5, 6, 64))
    assert isinstance(w, moe.ExpertWeights) and (w.experts, w.rows, w.cols, w.ggml_type) == (5, 6, 64, int(Q.Q8_0))
    assert w.matrix.data.shape == (30, row_bytes) and not w.matrix.tiled
    assert [dst - w.matrix.data.ptr for dst, _ in copies] == [0, experts.nbytes]
    assert copies[0][1] is experts.data and copies[1][1] is shared.data
