"""CpuOps.qk_norm_rotary_store_kv, the model's one call for Qwen3's per-head q/k norms, the rotation and the cache
write: bitwise rms_norm on q and on k followed by rotary_store_kv (what the model called before, and what the GPU's
fused kernel is tested against)."""

import numpy as np
import pytest

from infero.backends.cpu.ops import CpuKVCache, CpuOps
from infero.models.rotary import Rotary


@pytest.mark.parametrize("pairing", ["interleaved", "neox"])
@pytest.mark.parametrize("head_dim,rope_dim", [(64, 64), (128, 128), (128, 64)])
@pytest.mark.parametrize("q_a_slice", [False, True])  # Qwen3.5's q: the first half of each head of q and gate
def test_qk_norm_rotary_store_kv_equals_rms_norms_then_rotary_store_kv(pairing, head_dim, rope_dim, q_a_slice):
    ops, rng = CpuOps(), np.random.default_rng(head_dim + rope_dim + (pairing == "neox"))
    n, heads, kv_heads, block_size, eps = 5, 4, 2, 16, 1e-6
    q_gate = (rng.standard_normal((n, heads, 2 * head_dim)) * 3).astype(np.float32)
    q = q_gate[..., :head_dim] if q_a_slice else np.ascontiguousarray(q_gate[..., :head_dim])
    k = (rng.standard_normal((n, kv_heads, head_dim)) * 5).astype(np.float32)
    v = rng.standard_normal((n, kv_heads, head_dim)).astype(np.float32)
    q_norm, k_norm = (1 + 0.2 * rng.standard_normal((2, head_dim))).astype(np.float32)
    positions = np.array([0, 7, 300, 4095, 32767])
    slots = np.array([3, 40, 17, 0, 63])
    mscale = 1.0 if rope_dim == head_dim else 1.1
    rotary = Rotary(1e6 ** (-np.arange(0, rope_dim, 2) / rope_dim), pairing, rope_dim, mscale)
    inputs = [a.copy() for a in (q, k, v)]

    fused_cache, cache = (CpuKVCache(2, 4, block_size, kv_heads, head_dim) for _ in range(2))
    fused = ops.qk_norm_rotary_store_kv(q, k, v, q_norm, k_norm, eps, positions, rotary, fused_cache, 1, slots)
    normed_q, normed_k = ops.rms_norm(q, q_norm, eps), ops.rms_norm(k, k_norm, eps)
    unfused = ops.rotary_store_kv(normed_q, normed_k, v, positions, rotary, cache, 1, slots)

    assert fused.dtype == np.float32 and fused.shape == (n, heads, head_dim)
    assert np.array_equal(fused.view(np.uint32), unfused.view(np.uint32))
    for got, want in [(fused_cache.k, cache.k), (fused_cache.v, cache.v)]:
        assert all(np.array_equal(a.view(np.uint32), b.view(np.uint32)) for a, b in zip(got, want, strict=True))
    assert not fused_cache.k[0].any()  # another layer's cache is untouched
    for written in (fused_cache.k[1], fused_cache.v[1]):  # every token's slot holds its heads
        assert (written.reshape(-1, kv_heads, head_dim)[slots] != 0).any(axis=-1).all()
    for before, after in zip(inputs, (q, k, v), strict=True):
        assert np.array_equal(before, after)  # the op returns new arrays
