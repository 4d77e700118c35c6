"""kernels/elementwise.cu against numpy: outputs start poisoned (NaN), every case prints its error.

Bounds: fp32 math with a fixed reduction tree, so RMSNorm, SwiGLU and rotary (against a reference with the same
fp32 angles) agree with numpy to a few fp32 ulp: relative error (norm-wise) < 1e-5. The residual add is one
fp32 add per element: bitwise equal. Gathers and fp16 cache writes are copies: bitwise equal.
"""

import numpy as np
import pytest

from infero.models.rotary import Rotary

pytestmark = pytest.mark.gpu

RTOL = 1e-5


def rel_err(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def _dev(array):
    from infero.backends.cuda.tensor import from_host

    return from_host(np.ascontiguousarray(array))


def _poisoned(shape, dtype=np.float32):
    return _dev(np.full(shape, np.nan, dtype))


def _sync():
    from infero.backends.cuda import runtime

    runtime.stream().synchronize()


def _rms_norm_ref(x, w, eps):  # infero.backends.cpu.ops.CpuOps.rms_norm
    variance = np.mean(np.square(x, dtype=np.float32), axis=-1, keepdims=True)
    return (x / np.sqrt(variance + eps)) * w


@pytest.mark.parametrize("with_x", [True, False])
@pytest.mark.parametrize(
    "n,dim", [(1, 896), (3, 2048), (5, 3584), (17, 4096), (2, 5120), (4, 8192), (1, 16384), (7, 64)]
)
def test_add_rms_norm_matches_numpy(gpu, n, dim, with_x):
    from infero.backends.cuda import elementwise, runtime

    rng = np.random.default_rng(dim + n)
    residual = (rng.standard_normal((n, dim)) * 3).astype(np.float32)
    x = rng.standard_normal((n, dim)).astype(np.float32)
    w = (1 + 0.1 * rng.standard_normal(dim)).astype(np.float32)
    eps = 1e-6
    res_d, out_d = _dev(residual), _poisoned((n, dim))
    elementwise.add_rms_norm(out_d, res_d, _dev(x) if with_x else None, _dev(w), eps, runtime.stream())
    _sync()
    ref_res = residual + x if with_x else residual
    out, res = out_d.to_host(), res_d.to_host()
    err = rel_err(out, _rms_norm_ref(ref_res, w, eps))
    print(f"add_rms_norm n={n} dim={dim} x={with_x}: rel err {err:.2e}, residual exact {np.array_equal(res, ref_res)}")
    assert np.array_equal(res, ref_res)
    assert err < RTOL


@pytest.mark.parametrize(
    "shape", [(5, 32, 128), (3, 8, 64), (2, 4, 256), (1, 2, 512), (4, 1, 96), (6, 4096), (2, 1, 1024)]
)
def test_rms_norm_matches_numpy_over_last_dim(gpu, shape):
    from infero.backends.cuda import elementwise, runtime

    rng = np.random.default_rng(sum(shape))
    x = (rng.standard_normal(shape) * 2).astype(np.float32)
    w = (1 + 0.1 * rng.standard_normal(shape[-1])).astype(np.float32)
    out_d = _poisoned(shape)
    x_d = _dev(x)
    elementwise.rms_norm(out_d, x_d, _dev(w), 1e-6, runtime.stream())
    _sync()
    out = out_d.to_host()
    ref = _rms_norm_ref(x, w, 1e-6)
    row_errs = [rel_err(a, b) for a, b in zip(out.reshape(-1, shape[-1]), ref.reshape(-1, shape[-1]), strict=True)]
    print(f"rms_norm {shape}: rel err {rel_err(out, ref):.2e}, worst row {max(row_errs):.2e}")
    assert max(row_errs) < RTOL
    assert np.array_equal(x_d.to_host(), x)  # the input is untouched


def test_rms_norm_in_place_and_batch_invariant(gpu):
    from infero.backends.cuda import elementwise, runtime

    rng = np.random.default_rng(7)
    x = rng.standard_normal((33, 8, 128)).astype(np.float32)
    w = rng.standard_normal(128).astype(np.float32)
    x_d = _dev(x)
    elementwise.rms_norm(x_d, x_d, _dev(w), 1e-5, runtime.stream())
    one = _poisoned((1, 8, 128))
    elementwise.rms_norm(one, _dev(x[5:6]), _dev(w), 1e-5, runtime.stream())
    _sync()
    full = x_d.to_host()
    print(f"in place rel err {rel_err(full, _rms_norm_ref(x, w, 1e-5)):.2e}")
    assert rel_err(full, _rms_norm_ref(x, w, 1e-5)) < RTOL
    assert np.array_equal(full[5:6], one.to_host())


@pytest.mark.parametrize("n", [1, 7, 4096, 14336 * 3 + 2])
def test_swiglu_matches_numpy(gpu, n):
    from infero.backends.cuda import elementwise, runtime

    rng = np.random.default_rng(n)
    gate = (rng.standard_normal(n) * 4).astype(np.float32)
    gate[:3] = [-100.0, 100.0, 0.0][: min(3, n)]
    up = rng.standard_normal(n).astype(np.float32)
    out_d = _poisoned((n,))
    elementwise.swiglu(out_d, _dev(gate), _dev(up), runtime.stream())
    _sync()
    ref = gate / (1.0 + np.exp(-gate)) * up
    out = out_d.to_host()
    err = rel_err(out, ref)
    print(f"swiglu n={n}: rel err {err:.2e}, max abs {np.abs(out - ref).max():.2e}")
    assert np.isfinite(out).all() and err < RTOL


@pytest.mark.parametrize("dtype,cols", [(np.float32, 896), (np.float32, 151936), (np.float32, 3), (np.int32, 5),
                                        (np.float16, 7)])  # fmt: skip
def test_gather_rows_copies_exactly(gpu, dtype, cols):
    from infero.backends.cuda import elementwise, runtime
    from infero.backends.cuda.tensor import from_host

    rng = np.random.default_rng(cols)
    x = (rng.standard_normal((9, cols)) * 100).astype(dtype)
    idx = np.array([8, 0, 3, 3, 7], np.int32)
    out_d = from_host(np.zeros((5, cols), dtype) + (np.nan if np.issubdtype(dtype, np.floating) else -1))
    elementwise.gather_rows(out_d, _dev(x), _dev(idx), runtime.stream())
    _sync()
    assert np.array_equal(out_d.to_host(), x[idx])


def _rotary_ref(x, positions, inv_freq32, mscale, pairing, rope_dim, float32_angles):
    """infero.backends.cpu.ops.CpuOps.rotary; angles in float64 (the reference) or as the kernel makes them."""
    if float32_angles:
        angles = (positions.astype(np.float32)[:, None] * inv_freq32[None, :]).astype(np.float64)
    else:
        angles = positions.astype(np.float64)[:, None] * inv_freq32.astype(np.float64)[None, :]
    cos, sin = (np.cos(angles) * mscale)[:, None, :], (np.sin(angles) * mscale)[:, None, :]
    d = rope_dim
    out = x.copy()
    if pairing == "interleaved":
        a, b = x[..., 0:d:2], x[..., 1:d:2]
        out[..., 0:d:2] = a * cos - b * sin
        out[..., 1:d:2] = b * cos + a * sin
    else:
        a, b = x[..., : d // 2], x[..., d // 2 : d]
        out[..., : d // 2] = a * cos - b * sin
        out[..., d // 2 : d] = b * cos + a * sin
    return out


@pytest.mark.parametrize("pairing", ["interleaved", "neox"])
@pytest.mark.parametrize("heads,kv_heads,head_dim,rope_dim", [(8, 2, 128, 128), (4, 4, 64, 32), (6, 3, 96, 64),
                                                              (2, 1, 256, 256), (14, 2, 64, 64)])  # fmt: skip
def test_rotary_store_kv_matches_numpy(gpu, pairing, heads, kv_heads, head_dim, rope_dim):
    from infero.backends.cuda import elementwise, runtime

    rng = np.random.default_rng(heads * 1000 + head_dim + rope_dim + (pairing == "neox"))
    n, block_size, num_blocks = 37, 16, 11
    q = rng.standard_normal((n, heads, head_dim)).astype(np.float32)
    k = rng.standard_normal((n, kv_heads, head_dim)).astype(np.float32)
    v = rng.standard_normal((n, kv_heads, head_dim)).astype(np.float32)
    positions = rng.integers(0, 32768, n).astype(np.int32)
    positions[:3] = [0, 1, 32767]
    inv_freq = (10000.0 ** (-np.arange(0, rope_dim, 2, dtype=np.float64) / rope_dim)).astype(np.float32)
    mscale = 1.0 if rope_dim == head_dim else 1.1
    # Scattered slots in shuffled blocks; the last token is padding (slot -1) and writes nothing.
    slots = rng.permutation(num_blocks * block_size)[:n].astype(np.int64)
    slots[-1] = -1
    poison = np.full((num_blocks, block_size, kv_heads, head_dim), np.nan, np.float16)
    q_d, k_d, kc_d, vc_d = _dev(q), _dev(k), _dev(poison), _dev(poison)
    elementwise.rotary_store_kv(q_d, k_d, _dev(v), _dev(positions), _dev(inv_freq), mscale, pairing, rope_dim,
                                kc_d, vc_d, _dev(slots), runtime.stream())  # fmt: skip
    _sync()
    q_out, k_out, kc, vc = q_d.to_host(), k_d.to_host(), kc_d.to_host(), vc_d.to_host()
    q32 = _rotary_ref(q, positions, inv_freq, mscale, pairing, rope_dim, float32_angles=True)
    k32 = _rotary_ref(k, positions, inv_freq, mscale, pairing, rope_dim, float32_angles=True)
    q64 = _rotary_ref(q, positions, inv_freq, mscale, pairing, rope_dim, float32_angles=False)
    err_q, err_k = rel_err(q_out, q32), rel_err(k_out, k32)
    # Against float64 angles: |angle error| <= pos * inv_freq * 2^-23 per pair (kernels/elementwise.cu).
    bound = np.float64(positions.max()) * float(inv_freq.max()) * 2.0**-23 * mscale
    worst64 = float(np.abs(q_out - q64).max() / np.abs(q).max())
    print(f"rotary {pairing} H={heads} Hkv={kv_heads} D={head_dim} rope={rope_dim}: q err {err_q:.2e}, k err "
          f"{err_k:.2e}; vs float64 angles max {worst64:.2e} (bound {2 * bound:.2e})")  # fmt: skip
    assert err_q < RTOL and err_k < RTOL
    assert worst64 < 2 * bound + 1e-5
    assert np.array_equal(q_out[..., rope_dim:], q[..., rope_dim:])  # the unrotated tail passes through
    flat_k, flat_v = kc.reshape(-1, kv_heads, head_dim), vc.reshape(-1, kv_heads, head_dim)
    written = slots[slots >= 0]
    assert np.array_equal(flat_k[written], k_out[:-1].astype(np.float16))
    assert np.array_equal(flat_v[written], v[:-1].astype(np.float16))
    untouched = np.setdiff1d(np.arange(num_blocks * block_size), written)
    assert np.isnan(flat_k[untouched]).all() and np.isnan(flat_v[untouched]).all()


class _Float32Angles(Rotary):
    """Rotary with the kernels' angles, fp32(position * inv_freq) (inv_freq holding fp32 values), for CpuOps."""

    def cos_sin(self, positions):
        angles = (positions.astype(np.float32)[:, None] * self.inv_freq.astype(np.float32)[None, :]).astype(np.float64)
        return np.cos(angles) * self.mscale, np.sin(angles) * self.mscale


# Qwen3's per-head q/k norms fused into rotary_store_kv: bitwise rms_norm on q, on k, then rotary_store_kv (the
# launches it replaces), for head dims 64 and 128 (the GPU attention's) and 256 (two float4 a lane), both pairings,
# partial rotary, 1 to 64 tokens with padding tokens (slot -1); and the numpy op within the rotary test's bounds.
QK_NORM_SHAPES = [(32, 4, 128, 128), (16, 8, 128, 64), (12, 3, 64, 64), (14, 2, 64, 32), (4, 2, 256, 256)]


@pytest.mark.parametrize("n", [1, 3, 64])
@pytest.mark.parametrize("pairing", ["interleaved", "neox"])
@pytest.mark.parametrize("heads,kv_heads,head_dim,rope_dim", QK_NORM_SHAPES)
def test_qk_norm_rotary_store_kv_is_bitwise_rms_norms_then_rotary_store_kv(gpu, n, pairing, heads, kv_heads,
                                                                          head_dim, rope_dim):  # fmt: skip
    from infero.backends.cpu.ops import CpuKVCache, CpuOps
    from infero.backends.cuda import elementwise, runtime

    rng = np.random.default_rng(n * 100 + heads + head_dim + rope_dim + (pairing == "neox"))
    block_size, num_blocks, eps = 16, 9, 1e-6
    q = (rng.standard_normal((n, heads, head_dim)) * 3).astype(np.float32)
    k = (rng.standard_normal((n, kv_heads, head_dim)) * 5).astype(np.float32)
    v = rng.standard_normal((n, kv_heads, head_dim)).astype(np.float32)
    q_norm = (1 + 0.2 * rng.standard_normal(head_dim)).astype(np.float32)
    k_norm = (1 + 0.2 * rng.standard_normal(head_dim)).astype(np.float32)
    positions = rng.integers(0, 32768, n).astype(np.int32)
    positions[0] = 32767
    inv_freq = (1e6 ** (-np.arange(0, rope_dim, 2, dtype=np.float64) / rope_dim)).astype(np.float32)
    mscale = 1.0 if rope_dim == head_dim else 1.1
    slots = rng.permutation(num_blocks * block_size)[:n].astype(np.int64)
    slots[(n + 1) // 2 :: 2] = -1  # padding tokens (none at n = 1): normed and rotated in q, nothing in the cache
    stream, poison = runtime.stream(), np.full((num_blocks, block_size, kv_heads, head_dim), np.nan, np.float16)
    positions_d, inv_freq_d, slots_d, v_d = _dev(positions), _dev(inv_freq), _dev(slots), _dev(v)
    q_norm_d, k_norm_d = _dev(q_norm), _dev(k_norm)

    # The unfused sequence: rms_norm on q and on k (rms_norm_rows), then rotary_store_kv.
    q_ref, k_ref = _poisoned(q.shape), _poisoned(k.shape)
    kc_ref, vc_ref = _dev(poison), _dev(poison)
    elementwise.rms_norm(q_ref, _dev(q), q_norm_d, eps, stream)
    elementwise.rms_norm(k_ref, _dev(k), k_norm_d, eps, stream)
    elementwise.rotary_store_kv(q_ref, k_ref, v_d, positions_d, inv_freq_d, mscale, pairing, rope_dim, kc_ref,
                                vc_ref, slots_d, stream)  # fmt: skip
    # Fused: q normed and rotated in place, k left as it came.
    q_d, k_d, kc_d, vc_d = _dev(q), _dev(k), _dev(poison), _dev(poison)
    elementwise.qk_norm_rotary_store_kv(q_d, k_d, v_d, q_norm_d, k_norm_d, eps, positions_d, inv_freq_d, mscale,
                                        pairing, rope_dim, kc_d, vc_d, slots_d, stream)  # fmt: skip
    _sync()
    q_out, kc, vc = q_d.to_host(), kc_d.to_host(), vc_d.to_host()
    for name, got, want in [("q", q_out, q_ref.to_host()), ("k cache", kc, kc_ref.to_host()),
                            ("v cache", vc, vc_ref.to_host())]:  # fmt: skip
        bits = np.uint32 if got.dtype == np.float32 else np.uint16
        differ = np.argwhere(got.view(bits) != want.view(bits))
        assert not len(differ), f"{name}: {len(differ)} elements differ from the unfused, first {differ[0].tolist()}"
    assert np.isfinite(q_out).all()
    assert np.array_equal(k_d.to_host(), k)
    flat_k, flat_v = kc.reshape(-1, kv_heads, head_dim), vc.reshape(-1, kv_heads, head_dim)
    written = slots[slots >= 0]
    untouched = np.setdiff1d(np.arange(num_blocks * block_size), written)
    assert np.isfinite(flat_k[written]).all() and np.isfinite(flat_v[written]).all()
    assert np.isnan(flat_k[untouched]).all() and np.isnan(flat_v[untouched]).all()

    # Against numpy's op (CpuOps: float32 norms, float64 cos/sin). Its cache has a block more: a slot of -1 lands
    # in its last one, which the GPU skips.
    errors = {}
    for angles, rotary in [("fp32", _Float32Angles(inv_freq.astype(np.float64), pairing, rope_dim, mscale)),
                           ("float64", Rotary(inv_freq.astype(np.float64), pairing, rope_dim, mscale))]:  # fmt: skip
        cache = CpuKVCache(1, num_blocks + 1, block_size, kv_heads, head_dim)
        q_np = CpuOps().qk_norm_rotary_store_kv(q, k, v, q_norm, k_norm, eps, positions, rotary, cache, 0, slots)
        k_np, v_np = (c[0].reshape(-1, kv_heads, head_dim)[written] for c in (cache.k, cache.v))
        assert np.array_equal(flat_v[written], v_np.astype(np.float16))
        errors[angles] = (rel_err(q_out, q_np), rel_err(flat_k[written], k_np),
                          float(np.abs(q_out - q_np).max() / np.abs(q_np).max()))  # fmt: skip
    # Against float64 angles: |angle error| <= pos * inv_freq * 2^-23 per pair (kernels/elementwise.cu).
    bound = np.float64(positions.max()) * float(inv_freq.max()) * 2.0**-23 * mscale
    print(f"qk_norm_rotary_store_kv {pairing} n={n} H={heads} Hkv={kv_heads} D={head_dim} rope={rope_dim}: bitwise "
          f"the unfused launches; vs numpy, fp32 angles: q {errors['fp32'][0]:.2e}, k cache {errors['fp32'][1]:.2e}; "
          f"float64 angles: q max {errors['float64'][2]:.2e} (bound {2 * bound:.2e})")  # fmt: skip
    assert errors["fp32"][0] < RTOL
    assert errors["fp32"][1] < 2.0**-11 + RTOL  # the fp16 cache: half an fp16 ulp, relative
    assert errors["float64"][2] < 2 * bound + 1e-5
