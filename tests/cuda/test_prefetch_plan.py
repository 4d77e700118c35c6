"""prefetch.plan and the ops' choice of when to prefetch (no GPU: the plan is host-side bookkeeping)."""

from types import SimpleNamespace

from infero.backends.cuda import prefetch
from infero.backends.cuda.ops import CudaOps


def weight(ptr: int, nbytes: int):
    return SimpleNamespace(data=SimpleNamespace(ptr=ptr), nbytes=nbytes)


def ranges(pf):
    return [(pf.ptr[i] or 0, pf.bytes[i]) for i in range(prefetch.RANGES) if pf.bytes[i]]


def test_plan_takes_the_first_bytes_in_reading_order_up_to_the_budget(monkeypatch):
    monkeypatch.setattr(prefetch, "MAX_BYTES", 10_008)
    pf = prefetch.plan([weight(1 << 20, 4_000), weight(2 << 20, 4_800), weight(3 << 20, 9_000)])
    assert ranges(pf) == [(1 << 20, 4_000), (2 << 20, 4_800), (3 << 20, 1_200)]  # 1,208 left, cut to 16 bytes
    assert pf.blocks == prefetch.BLOCKS and pf.first_block == 0


def test_plan_skips_unaligned_weights_and_stops_at_four_ranges(monkeypatch):
    monkeypatch.setattr(prefetch, "MAX_BYTES", 1 << 30)
    pf = prefetch.plan([weight(4096 * (i + 1) + (8 if i == 1 else 0), 1_000) for i in range(6)])
    assert [p for p, _ in ranges(pf)] == [4096, 3 * 4096, 4 * 4096, 5 * 4096]
    assert all(b == 992 for _, b in ranges(pf))
    assert prefetch.plan([]) is None and prefetch.plan([weight(4096, 8)]) is None


def test_for_launch_appends_the_prefetch_ctas_to_the_grid():
    pf = prefetch.plan([weight(4096, 1 << 20)])
    struct, grid = prefetch.for_launch(pf, 14)
    assert struct.first_block == 14 and grid == 14 + prefetch.BLOCKS
    assert prefetch.for_launch(None, 14) == (prefetch.NONE, 14) and prefetch.NONE.blocks == 0


def test_ops_prefetch_only_for_steps_that_stream_weights(monkeypatch):
    from infero.backends.cuda.tensor import QuantWeight

    ops = CudaOps(backend=None)
    data = SimpleNamespace(ptr=1 << 20, nbytes=1 << 20)
    w = QuantWeight(data, 12, 256, 4096)
    assert ops._prefetch_plan(1, (w,)) is not None
    assert ops._prefetch_plan(prefetch.MAX_TOKENS, (w,)) is ops._prefetch_plan(1, (w,))  # cached
    assert ops._prefetch_plan(prefetch.MAX_TOKENS + 1, (w,)) is None
    assert ops._prefetch_plan(1, ("not a quantized matrix",)) is None
