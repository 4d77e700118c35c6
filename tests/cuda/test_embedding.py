"""The embedding lookup is bitwise gguf's dequantization of the selected rows, for every weight type.

This is also the GPU check of dequant8 (quant.cuh), which the GEMM shares: every element of every selected row
must equal gguf's float32 value bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize
from tiny_gguf import ALL_TYPES, encode_weight

pytestmark = pytest.mark.gpu

K_TYPES = (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS)
FLOAT_TYPES = (Q.F32, Q.F16, Q.BF16)
# (vocab, hidden): 896 is not a multiple of 256; 1003 (float tables) is not a multiple of 8.
CASES = (
    [(t, (300, 4096)) for t in ALL_TYPES]
    + [(t, (301, 896)) for t in ALL_TYPES if t not in K_TYPES]
    + [(t, (77, 1003)) for t in FLOAT_TYPES]
)


def table_case(qtype: Q, vocab: int, hidden: int, seed: int = 0):
    from infero.backends.cuda.tensor import QuantWeight, from_host

    rng = np.random.default_rng(seed + vocab * 13 + hidden + int(qtype))
    data, _ = encode_weight(rng.normal(0, 0.5, size=(vocab, hidden)).astype(np.float32), qtype, rng)
    raw = np.ascontiguousarray(data).view(np.uint8).reshape(vocab, -1)
    return QuantWeight(from_host(raw), int(qtype), vocab, hidden), np.asarray(
        dequantize(raw, qtype), np.float32
    ).reshape(vocab, hidden)


def lookup(table, ids: np.ndarray) -> np.ndarray:
    from infero.backends.cuda import driver, embedding, runtime
    from infero.backends.cuda.tensor import empty, from_host

    stream = runtime.stream()
    out = empty((len(ids), table.cols), np.float32)
    driver.memset_d8(out.ptr, 0xFF, out.nbytes, stream)  # NaN: an element never written shows
    embedding.embedding(out, table, from_host(ids.astype(np.int32)), stream)
    stream.synchronize()
    return out.to_host()


@pytest.mark.parametrize("qtype, shape", CASES, ids=[f"{t.name}-{v}x{h}" for t, (v, h) in CASES])
def test_embedding_is_bitwise_gguf_dequantization(gpu, qtype, shape):
    vocab, hidden = shape
    table, ref_table = table_case(qtype, vocab, hidden)
    ids = np.array([0, vocab - 1, 5, 5, 17, vocab // 2, 1, vocab - 2, 3, 250 % vocab, 42], np.int32)
    out = lookup(table, ids)
    ref = ref_table[ids]
    differ = np.argwhere(out.view(np.uint32) != ref.view(np.uint32))
    if len(differ):
        i, e = differ[0]
        rows = sorted({int(ids[k]) for k, _ in differ})
        cols = np.unique(differ[:, 1] % 256)
        nans = int(np.isnan(out).sum())
        pytest.fail(f"{qtype.name} {vocab}x{hidden}: {len(differ)} of {out.size} values differ (NaN {nans}); first "
                    f"token #{i} (id {ids[i]}) element {e}: {out[i, e]!r} vs gguf {ref[i, e]!r}; table rows "
                    f"{rows[:8]}; element positions mod 256 {cols[:16].tolist()}")  # fmt: skip


def test_embedding_marks_out_of_range_ids_with_nan(gpu):
    table, ref_table = table_case(Q.Q4_K, 64, 256)
    out = lookup(table, np.array([3, 64, -1, 63], np.int32))
    assert np.isnan(out[1]).all() and np.isnan(out[2]).all()
    assert np.array_equal(out[0].view(np.uint32), ref_table[3].view(np.uint32))
    assert np.array_equal(out[3].view(np.uint32), ref_table[63].view(np.uint32))


def test_feed_tokens_writes_the_sampled_tokens_where_rows_say(gpu):
    """Asynchronous scheduling's input tokens: token i = sampled[rows[i]] where rows[i] >= 0, others untouched; a
    negative sampled id (a failed sampling) is fed as 0, never as an index outside the table."""
    from infero.backends.cuda import embedding, runtime
    from infero.backends.cuda.tensor import from_host

    token_ids = from_host(np.array([11, 12, 13, 14, 15], np.int32))
    sampled = from_host(np.array([7, -1, 42], np.int32))
    rows = from_host(np.array([2, -1, 0, 1, -1], np.int32))
    embedding.feed_tokens(token_ids, sampled.ptr, rows, runtime.stream())
    assert token_ids.to_host(runtime.stream()).tolist() == [42, 12, 7, 0, 15]
