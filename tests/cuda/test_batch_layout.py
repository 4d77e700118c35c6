"""The device batch buffer's layout: a step copies one prefix of it, through its own block-table rows. Runs
without a GPU."""

from infero.backends.cuda import _BatchLayout


def test_a_step_copies_only_its_block_table_rows():
    lay = _BatchLayout(max_tokens=8192, max_rows=64, max_blocks=8193)  # llama-3.1-8b: 131,072 tokens, 64 sequences
    tables = lay.offsets["block_tables"]
    assert tables == max(lay.offsets.values()), "block_tables must come last"
    for name, offset in lay.offsets.items():
        assert offset % 256 == 0, name
    assert lay.end_of_tables(1) == tables + 4 * 8193
    assert lay.end_of_tables(1) < 250_000 < 2_000_000 < lay.end_of_tables(64) <= lay.nbytes
