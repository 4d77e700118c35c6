"""attention.decode_splits: how a decode launch spreads a sequence's key tiles over CTAs (no GPU needed). The split
count never changes a query's bits (tests/cuda/test_attention.py asserts that on the GPU); it only sizes the grid."""

import pytest

from infero.backends.cuda.attention import decode_splits

SLOTS = 3 * 132  # the H200's decode CTAs at once at head dim 128


@pytest.mark.parametrize(
    "units, tiles, splits",
    [
        (4, 8, 8),  # batch 1 of 4 kv heads: a CTA a tile
        (4, 1000, 99),  # ... up to the CTAs that fit at once
        (32, 8, 8),  # 8 sequences x 4 kv heads
        (64, 32, 6),  # 8 x 8: 384 CTAs, one wave (7 would make 448)
        (128, 8, 3),  # 32 x 4: 384 CTAs, one wave
        (198, 32, 2),  # the units fill half the GPU: still split
        (199, 32, 1),  # more than half: a CTA a unit
        (256, 8, 1),  # 32 x 8 or 64 x 4: never split
        (512, 32, 1),
        (128, 1, 1),  # a single tile has nothing to split
    ],
)
def test_splits_fill_one_wave_unless_the_units_alone_fill_half(units, tiles, splits):
    assert decode_splits(units, tiles, SLOTS) == splits
    assert units * splits <= SLOTS or splits == 1


def test_no_slots_means_one_cta_a_unit():
    assert decode_splits(4, 64, 0) == 1
