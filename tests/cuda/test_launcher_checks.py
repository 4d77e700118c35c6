"""elementwise.qk_norm_rotary_store_kv refuses what its kernel cannot take, in one line, before any launch (no GPU
needed: the checks read only shapes, dtypes and addresses)."""

import numpy as np
import pytest
from helpers import record_launches
from helpers import stand_in as tensor

from infero.backends.cuda import elementwise


def call(n=2, heads=4, kv_heads=2, head_dim=128, rope_dim=128, q_norm=None, q_ptr=1 << 20):
    cache = tensor((3, 16, kv_heads, head_dim), np.float16)
    elementwise.qk_norm_rotary_store_kv(
        tensor((n, heads, head_dim), ptr=q_ptr), tensor((n, kv_heads, head_dim)), tensor((n, kv_heads, head_dim)),
        q_norm or tensor((head_dim,)), tensor((head_dim,)), 1e-6, tensor((n,), np.int32), tensor((rope_dim // 2,)),
        1.0, "neox", rope_dim, cache, cache, tensor((n,), np.int64), None,
    )  # fmt: skip


@pytest.fixture
def launches(monkeypatch):
    return record_launches(monkeypatch, elementwise)


@pytest.mark.parametrize("head_dim,vpt", [(64, 1), (128, 1), (256, 2), (512, 4)])
def test_the_norm_takes_rms_norms_row_per_warp_instantiation_and_a_warp_per_head(launches, head_dim, vpt):
    call(n=3, heads=14, kv_heads=2, head_dim=head_dim, rope_dim=head_dim)
    assert launches == [(f"qk_norm_rotary_store_kv<{vpt}, true>", (3, 2), (256,))]  # 16 heads: 2 blocks of 8 warps


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(q_norm=tensor((64,))), "q_norm has 64 elements, heads have 128"),
        (dict(q_norm=tensor((128,), np.float16)), "q_norm must be float32"),
        (dict(head_dim=130, rope_dim=2), "divisible by 4"),
        (dict(q_ptr=(1 << 20) + 8), "16-byte aligned"),
        (dict(head_dim=1024, rope_dim=1024), "head_dim must be even and <= 512"),  # rotary_store_kv's checks too
    ],
)
def test_the_launcher_refuses_what_the_kernel_cannot_take(launches, kwargs, message):
    with pytest.raises(ValueError, match=message):
        call(**kwargs)
    assert not launches


def test_q_may_be_read_from_the_q_half_of_wider_heads_and_no_other_columns(launches):
    """Qwen3.5's [q | gate] heads: q_in columns [0, 128) of heads of 256 feed a contiguous q."""
    from infero.backends.cuda.tensor import columns

    n, heads = 2, 4
    q_gate = tensor((n, heads, 256))

    def call_with(q_in):
        cache = tensor((3, 16, 2, 128), np.float16)
        elementwise.qk_norm_rotary_store_kv(
            tensor((n, heads, 128)), tensor((n, 2, 128)), tensor((n, 2, 128)), tensor((128,)), tensor((128,)), 1e-6,
            tensor((n,), np.int32), tensor((32,)), 1.0, "neox", 64, cache, cache, tensor((n,), np.int64), None, q_in,
        )  # fmt: skip

    call_with(columns(q_gate, 0, 128))
    assert len(launches) == 1
    with pytest.raises(ValueError, match="q_in must be 8 float32 heads of 128"):
        call_with(columns(q_gate, 0, 64))
    assert len(launches) == 1
