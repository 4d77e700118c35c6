"""paged_attention against the numpy reference (`_causal_gqa` on the gathered fp16 K/V): decode through the
split-KV kernel, prefill chunks over cached prefixes, mixed batches; GQA ratios 1, 3, 4, 8 and 20, head_dim
64, 128 and 256 (Qwen3.5's gated attention: 16 query heads over 2 kv heads), block sizes 16 and 32; bitwise batch
invariance; a query decoded bitwise the same query inside any prefill chunk (the tile fold, batch invariance rule 3);
and at head_dim 256 the one-stage kernels (GPUs whose shared memory does not hold two) bitwise the two-stage ones.

Every case fills unused cache blocks and the slots past each context with NaN, shuffles the block tables, and
poisons the output and the workspace with NaN, so a read of a wrong slot or a row left unwritten shows.

Tolerance: relative (Frobenius) error 2e-3 per case, and 5e-3 for the worst single (token, head) row. The
kernels round q and the softmax probabilities to fp16 for the tensor cores (relative rounding at most
2^-11 = 4.9e-4, about half that on average, independent from element to element); K/V are fp16 in the cache
and the reference reads the same fp16 values; everything else is fp32. With unit-variance scores that gives
about 3e-4 expected error (2-3e-4 in a numpy emulation of the kernels' rounding, worst row 7e-4), so 2e-3
keeps a margin while any wrong key, head, mask or block gives 1e-1.
Run with -s to see every case's numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from infero.backends.cpu.ops import _causal_gqa

pytestmark = pytest.mark.gpu

CONFIGS = {  # name: (num_heads, num_kv_heads, head_dim)
    "mha_h6_kv6_d64": (6, 6, 64),
    "mha_h4_kv4_d128": (4, 4, 128),
    "smollm2_h9_kv3_d64": (9, 3, 64),
    "llama8b_h32_kv8_d128": (32, 8, 128),
    "gqa8_h8_kv1_d64": (8, 1, 64),
    "gqa8_h16_kv2_d128": (16, 2, 128),
    "gqa20_h20_kv1_d64": (20, 1, 64),  # a group of more than 16 heads: two decode row tiles
    "mha_h4_kv4_d256": (4, 4, 256),
    "qwen35_h16_kv2_d256": (16, 2, 256),  # Qwen3.5-35B-A3B's gated attention layers
    "gqa20_h20_kv1_d256": (20, 1, 256),
}
TOLERANCE, ROW_TOLERANCE = 2e-3, 5e-3


@dataclass
class Case:
    q: np.ndarray  # float32 [num_tokens, num_heads, head_dim]
    k_cache: np.ndarray  # float16 [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: np.ndarray
    block_tables: np.ndarray  # int32 [num_seqs, max_blocks], -1 past each sequence's blocks
    context_lens: np.ndarray  # int32 [num_seqs]
    query_lens: np.ndarray  # int32 [num_seqs]

    @property
    def query_starts(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.query_lens)]).astype(np.int32)

    @property
    def scale(self) -> float:
        return 1.0 / np.sqrt(self.q.shape[2])

    def subset(self, seqs: list[int]) -> Case:
        """The same sequences over the same cache, in a batch of their own."""
        starts = self.query_starts
        rows = np.concatenate([np.arange(starts[s], starts[s + 1]) for s in seqs]).astype(np.int64)
        return Case(self.q[rows], self.k_cache, self.v_cache, self.block_tables[seqs], self.context_lens[seqs],
                    self.query_lens[seqs])  # fmt: skip

    def rows_of(self, s: int) -> slice:
        starts = self.query_starts
        return slice(int(starts[s]), int(starts[s + 1]))


def make_case(seqs: list[tuple[int, int]], config: str, block_size: int = 16, seed: int = 0) -> Case:
    """seqs: (query_len, context_len) per sequence; the cache holds random fp16 K/V, everything else NaN."""
    num_heads, num_kv_heads, head_dim = CONFIGS[config]
    rng = np.random.default_rng(seed)
    blocks_per_seq = [-(-ctx // block_size) for _, ctx in seqs]
    num_blocks = sum(blocks_per_seq) + 5
    order = rng.permutation(num_blocks)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = np.full(shape, np.nan, np.float16), np.full(shape, np.nan, np.float16)
    tables = np.full((len(seqs), max(blocks_per_seq) + 1), -1, np.int32)
    taken = 0
    for i, (_, ctx) in enumerate(seqs):
        ids = order[taken : taken + blocks_per_seq[i]]
        taken += blocks_per_seq[i]
        tables[i, : len(ids)] = ids
        pos = np.arange(ctx)
        for cache in (k_cache, v_cache):
            cache[ids[pos // block_size], pos % block_size] = rng.standard_normal((ctx, num_kv_heads, head_dim))
    q_lens = np.array([n for n, _ in seqs], np.int32)
    q = rng.standard_normal((int(q_lens.sum()), num_heads, head_dim)).astype(np.float32)
    return Case(q, k_cache, v_cache, tables, np.array([c for _, c in seqs], np.int32), q_lens)


def reference(case: Case) -> np.ndarray:
    out = np.full(case.q.shape, np.nan)
    block_size = case.k_cache.shape[1]
    for s in range(len(case.context_lens)):
        rows = case.rows_of(s)
        if rows.start == rows.stop:
            continue
        pos = np.arange(case.context_lens[s])
        blocks = case.block_tables[s][pos // block_size]
        k = case.k_cache[blocks, pos % block_size].astype(np.float64)
        v = case.v_cache[blocks, pos % block_size].astype(np.float64)
        out[rows] = _causal_gqa(case.q[rows].astype(np.float64), k, v, case.scale)
    return out


_workspace = {}


def run_gpu(case: Case, max_context_len: int | None = None, num_decode_seqs: int | None = None, quantized=None):
    from infero.backends.cuda import attention, driver, runtime, tensor

    stream = runtime.stream()
    ws = _workspace.get("ws")
    if ws is None:
        ws = _workspace["ws"] = tensor.Workspace(64 << 20)
    ws.reset()
    driver.memset_d8(ws.memory.ptr, 0xFF, ws.memory.nbytes, stream)  # NaN partials: unwritten splits show
    q, k, v = tensor.from_host(case.q), tensor.from_host(case.k_cache), tensor.from_host(case.v_cache)
    tables, ctx = tensor.from_host(case.block_tables), tensor.from_host(case.context_lens)
    starts = tensor.from_host(case.query_starts)
    out = tensor.empty(case.q.shape, np.float32)
    driver.memset_d8(out.ptr, 0xFF, out.nbytes, stream)  # NaN: rows the kernels skip show
    runtime.context().synchronize()  # the uploads went through the legacy stream
    attention.paged_attention(
        out, q, k, v, tables, ctx, starts, case.scale, int(case.query_lens.max()),
        max_context_len or int(case.context_lens.max()), stream, ws, num_decode_seqs=num_decode_seqs,
        quantized=quantized,
    )  # fmt: skip
    stream.synchronize()
    assert ws.offset == 0, f"paged_attention kept {ws.offset} bytes of workspace"
    return out.to_host()


def check(name: str, got: np.ndarray, ref: np.ndarray) -> None:
    """Assert and print this case's errors; rows the reference does not define (q_len 0) are absent."""
    nan = int(np.isnan(got).sum())
    diff = np.asarray(got, np.float64) - ref
    rel = float(np.linalg.norm(diff) / max(np.linalg.norm(ref), 1e-30)) if nan == 0 else float("inf")
    rows = np.linalg.norm(diff, axis=-1) / np.maximum(np.linalg.norm(ref, axis=-1), 1e-30)
    worst = float(np.max(rows)) if nan == 0 else float("inf")
    where = np.unravel_index(np.argmax(np.nan_to_num(rows, nan=np.inf)), rows.shape)
    max_abs = float(np.nanmax(np.abs(diff))) if nan < got.size else float("nan")
    line = f"{name}: rel_err {rel:.2e} worst_row {worst:.2e} at (token, head) {tuple(map(int, where))} " \
           f"max_abs {max_abs:.2e} nan {nan}/{got.size}"  # fmt: skip
    print(line)
    assert nan == 0, line
    assert rel < TOLERANCE, line
    assert worst < ROW_TOLERANCE, line


def assert_bitwise(name: str, got: np.ndarray, want: np.ndarray) -> None:
    same = got.view(np.uint32) == want.view(np.uint32)
    bad = int(np.sum(~same))
    first = np.argwhere(~same)[0].tolist() if bad else None
    line = f"{name}: {bad} of {got.size} elements differ in bits (first at {first})"
    print(line)
    assert bad == 0, line


# --- decode ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ctx", [1, 15, 16, 17, 1000, 5000])
@pytest.mark.parametrize("config", CONFIGS)
def test_decode_single_sequence_matches_reference(gpu, config, ctx):
    case = make_case([(1, ctx)], config, seed=ctx)
    check(f"decode {config} ctx={ctx}", run_gpu(case), reference(case))


@pytest.mark.parametrize("config", ["smollm2_h9_kv3_d64", "llama8b_h32_kv8_d128", "qwen35_h16_kv2_d256"])
def test_decode_past_2048_keys_folds_every_tile_partial(gpu, config, monkeypatch):
    """20,000 keys are 313 tile partials, folded by the merge in rounds of 32: the same bits as one CTA folding them
    all, as a launch whose partial slots are too few for the sequence (CTA 0 folds it), and as the last row of a
    prefill chunk ending at the same position."""
    from infero.backends.cuda import attention

    case = make_case([(1, 20000)], config, seed=5)
    spread = run_gpu(case)
    check(f"decode {config} ctx=20000", spread, reference(case))
    monkeypatch.setattr(attention, "DECODE_CTAS_PER_SM", 0)
    assert_bitwise(f"decode {config} ctx=20000 one CTA vs spread", run_gpu(case), spread)
    monkeypatch.undo()
    monkeypatch.setattr(attention, "PARTIALS_BYTES", 1 << 18)  # slots for fewer than 313 tiles
    assert_bitwise(f"decode {config} ctx=20000 past the partial slots vs spread", run_gpu(case), spread)
    monkeypatch.undo()
    chunk = Case(np.repeat(case.q, 100, axis=0), case.k_cache, case.v_cache, case.block_tables,
                 np.array([20000], np.int32), np.array([100], np.int32))  # fmt: skip
    assert_bitwise(f"decode {config} ctx=20000 vs prefill chunk", run_gpu(chunk)[99:100], spread)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("config", CONFIGS)
def test_decode_batch_of_mixed_lengths_matches_reference(gpu, config, block_size):
    lens = [1, 7, 16, 33, 255, 256, 257, 3000]
    case = make_case([(1, n) for n in lens], config, block_size, seed=block_size)
    check(f"decode batch {config} bs={block_size} ctx={lens}", run_gpu(case), reference(case))


@pytest.mark.parametrize("config", CONFIGS)
def test_decode_is_batch_invariant(gpu, config, monkeypatch):
    """A sequence's bits do not depend on its batch, the grid's max_context_len (a graph's bound) or how many
    CTAs share its splits."""
    from infero.backends.cuda import attention

    lens = [1, 17, 300, 513, 1000, 2049, 5000, 64]
    case = make_case([(1, n) for n in lens], config, seed=7)
    batch = run_gpu(case)
    check(f"decode invariance batch {config}", batch, reference(case))
    assert_bitwise(f"decode {config} max_context_len 40000 vs tight", run_gpu(case, max_context_len=40000), batch)
    monkeypatch.setattr(attention, "DECODE_CTAS_PER_SM", 0)  # one CTA per (sequence, kv head) walks all splits
    assert_bitwise(f"decode {config} one CTA per sequence vs spread", run_gpu(case), batch)
    monkeypatch.undo()
    for s, n in enumerate(lens):
        alone = run_gpu(case.subset([s]))
        assert_bitwise(f"decode {config} ctx={n} alone vs in batch", alone, batch[case.rows_of(s)])


@pytest.mark.parametrize(
    "config", ["smollm2_h9_kv3_d64", "llama8b_h32_kv8_d128", "gqa20_h20_kv1_d64", "qwen35_h16_kv2_d256"]
)
def test_decode_writes_its_output_in_the_matvec_activation_format(gpu, config):
    """Asked to, decode attention also writes its output quantized for the output projection's mat-vec: from
    the decode kernel where one CTA folds every tile (context <= 64), from the merge otherwise. Bitwise numpy's
    quantization of the float output, which itself stays bitwise what it is without quantizing."""
    from test_matvec import assert_quantized_like_numpy

    from infero.backends.cuda import driver, matvec, runtime
    from infero.backends.cuda.tensor import empty

    lens = [1, 17, 64, 65, 300, 5000]
    case = make_case([(1, n) for n in lens], config, seed=23)
    plain = run_gpu(case)
    num_heads, _, head_dim = CONFIGS[config]
    q_shape, s_shape = matvec.activation_shapes(len(lens), num_heads * head_dim)
    xq, xs = empty(q_shape, np.int8), empty(s_shape, np.int32)
    stream = runtime.stream()
    driver.memset_d8(xq.ptr, 0x7F, xq.nbytes, stream)
    driver.memset_d8(xs.ptr, 0xFF, xs.nbytes, stream)
    got = run_gpu(case, quantized=(xq, xs))
    assert_bitwise(f"decode {config} out with quantizing vs without", got, plain)
    assert_quantized_like_numpy(xq, xs, got.reshape(len(lens), -1))
    print(f"decode {config} ctx={lens}: quantized output bitwise numpy's")


def test_quantized_output_needs_a_decode_only_batch(gpu):
    from infero.backends.cuda import matvec
    from infero.backends.cuda.tensor import empty

    case = make_case([(1, 100), (5, 40)], "smollm2_h9_kv3_d64", seed=29)
    q_shape, s_shape = matvec.activation_shapes(6, 9 * 64)
    with pytest.raises(ValueError, match="every token must be a decode token"):
        run_gpu(case, quantized=(empty(q_shape, np.int8), empty(s_shape, np.int32)))


def test_decode_context_beyond_max_context_len_gives_nan(gpu):
    case = make_case([(1, 1000), (1, 100)], "smollm2_h9_kv3_d64", seed=3)
    got = run_gpu(case, max_context_len=256)  # a contract breach for the first sequence
    print(f"breach: NaN in sequence 0: {np.isnan(got[0]).all()}, sequence 1 finite: {np.isfinite(got[1]).all()}")
    assert np.isnan(got[0]).all()
    check("breach: the other sequence", got[1:], reference(case)[1:])


# --- prefill chunks -------------------------------------------------------------------------------------


@pytest.mark.parametrize("prefix", [0, 37, 500])
@pytest.mark.parametrize("q_len", [1, 2, 15, 16, 17, 63, 64, 65, 100, 300])
@pytest.mark.parametrize("config", CONFIGS)
def test_prefill_chunk_matches_reference(gpu, config, q_len, prefix):
    case = make_case([(q_len, prefix + q_len)], config, seed=q_len * 1000 + prefix)
    check(f"prefill {config} q_len={q_len} prefix={prefix}", run_gpu(case), reference(case))


@pytest.mark.parametrize(
    "config", ["smollm2_h9_kv3_d64", "llama8b_h32_kv8_d128", "gqa20_h20_kv1_d64", "qwen35_h16_kv2_d256"]
)
def test_prefill_block_size_32_and_pure_prefill_hint(gpu, config):
    case = make_case([(300, 300), (77, 577), (2, 33)], config, block_size=32, seed=11)
    got = run_gpu(case)
    check(f"prefill bs=32 {config}", got, reference(case))
    assert_bitwise(f"prefill {config} num_decode_seqs=0 vs None", run_gpu(case, num_decode_seqs=0), got)


@pytest.mark.parametrize("config", CONFIGS)
def test_prefill_is_batch_invariant(gpu, config):
    seqs = [(300, 300), (17, 517), (64, 101), (2, 2)]
    case = make_case(seqs, config, seed=13)
    batch = run_gpu(case)
    check(f"prefill invariance batch {config}", batch, reference(case))
    for s, (q_len, ctx) in enumerate(seqs):
        alone = run_gpu(case.subset([s]))
        assert_bitwise(f"prefill {config} q_len={q_len} ctx={ctx} alone vs in batch", alone, batch[case.rows_of(s)])


# --- mixed batches --------------------------------------------------------------------------------------

MIXED = [(1, 100), (37, 537), (1, 2000), (300, 300), (5, 5), (1, 1), (0, 50), (2, 600), (1, 5000)]


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("config", CONFIGS)
def test_mixed_batch_matches_reference(gpu, config, block_size):
    case = make_case(MIXED, config, block_size, seed=17)
    check(f"mixed {config} bs={block_size}", run_gpu(case), reference(case))


@pytest.mark.parametrize("config", CONFIGS)
def test_decode_in_mixed_batch_matches_pure_decode_bitwise(gpu, config):
    case = make_case(MIXED, config, seed=19)
    mixed = run_gpu(case)
    decodes = [s for s, (n, _) in enumerate(MIXED) if n == 1]
    pure = run_gpu(case.subset(decodes))
    for i, s in enumerate(decodes):
        assert_bitwise(f"mixed vs pure decode {config} ctx={MIXED[s][1]}", mixed[case.rows_of(s)], pure[i : i + 1])


# --- a query decoded vs the same query in a prefill chunk (batch invariance rule 3) ------------------------------

FOLD_CONFIGS = [  # head dim 64 / 128 / 256, GQA groups 1 / 4 / 8
    "mha_h6_kv6_d64",
    "gqa8_h8_kv1_d64",
    "llama8b_h32_kv8_d128",
    "gqa8_h16_kv2_d128",
    "mha_h4_kv4_d256",
    "qwen35_h16_kv2_d256",
]
FOLD_CONTEXTS = [1, 63, 64, 65, 600, 2048, 2049, 3000]
FOLD_CHUNKS = [2, 7, 64, 300]


def _chunk_of(case: Case, queries: np.ndarray, pos: int, q_len: int, offset: int) -> Case:
    """The query at position pos as row `offset` of a prefill chunk of q_len new tokens over case's first sequence's
    cache; queries holds one query row per cache position."""
    start = pos - offset
    return Case(queries[start : start + q_len], case.k_cache, case.v_cache, case.block_tables[:1],
                np.array([start + q_len], np.int32), np.array([q_len], np.int32))  # fmt: skip


def _decoded(case: Case, queries: np.ndarray, positions: list[int]) -> Case:
    """Decode batch over case's first sequence's cache: the query at each position as one new token over the keys
    up to it (sequences may share blocks: they only read them)."""
    return Case(queries[positions], case.k_cache, case.v_cache, case.block_tables[[0] * len(positions)],
                np.array([p + 1 for p in positions], np.int32), np.ones(len(positions), np.int32))  # fmt: skip


def _queries(case: Case, seed: int) -> np.ndarray:
    positions = int(case.context_lens[0])
    return np.random.default_rng(seed).standard_normal((positions,) + case.q.shape[1:]).astype(np.float32)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("ctx", FOLD_CONTEXTS)
@pytest.mark.parametrize("config", FOLD_CONFIGS)
def test_decoded_query_is_bitwise_its_row_in_any_prefill_chunk(gpu, config, ctx, block_size, monkeypatch):
    """A query at position ctx - 1 decoded (alone, in a decode batch, in a mixed batch, by one CTA or spread over
    CTAs) gives the bits of its row inside prefill chunks of 2, 7, 64 and 300 tokens that hold it first, in the
    middle or last."""
    from infero.backends.cuda import attention

    pos, cached = ctx - 1, ctx + 300
    cache = make_case([(1, cached)], config, block_size, seed=ctx * 7 + block_size)
    queries = _queries(cache, seed=ctx)
    alone = _decoded(cache, queries, [pos])
    decoded = run_gpu(alone)
    check(f"fold {config} ctx={ctx} bs={block_size} decode", decoded, reference(alone))
    for q_len in FOLD_CHUNKS:
        for offset in sorted({0, q_len // 2, q_len - 1}):
            if offset > pos:
                continue
            chunk = run_gpu(_chunk_of(cache, queries, pos, q_len, offset))
            assert_bitwise(f"fold {config} ctx={ctx} bs={block_size} chunk {q_len} row {offset} vs decode",
                           chunk[offset : offset + 1], decoded)  # fmt: skip

    # Beside others: decodes of other lengths over the same blocks, then also a prompt's first chunk of 37 tokens.
    decodes = _decoded(cache, queries, [pos, 10, cached - 1])
    assert_bitwise(f"fold {config} ctx={ctx} bs={block_size} in a decode batch vs alone", run_gpu(decodes)[:1],
                   decoded)  # fmt: skip
    prompt = _chunk_of(cache, queries, 36, 37, 36)
    mixed = Case(np.concatenate([decodes.q, prompt.q]), cache.k_cache, cache.v_cache,
                 cache.block_tables[[0, 0, 0, 0]], np.concatenate([decodes.context_lens, prompt.context_lens]),
                 np.concatenate([decodes.query_lens, prompt.query_lens]))  # fmt: skip
    assert_bitwise(f"fold {config} ctx={ctx} bs={block_size} in a mixed batch vs alone", run_gpu(mixed)[:1], decoded)
    monkeypatch.setattr(attention, "DECODE_CTAS_PER_SM", 0)  # one CTA folds every tile
    assert_bitwise(f"fold {config} ctx={ctx} bs={block_size} one CTA vs spread", run_gpu(decodes)[:1], decoded)


# --- stages ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("config", ["mha_h4_kv4_d256", "qwen35_h16_kv2_d256", "gqa20_h20_kv1_d256"])
def test_one_stage_kernels_give_the_two_stage_bits(gpu, config, monkeypatch):
    """At head_dim 256 a GPU whose blocks cannot opt in to 132 KiB of shared memory (sm_86, sm_89) runs the
    one-stage kernels: forced here, they must give the bits of the two-stage ones over prefill tiles, decode splits
    of several tiles (context 5,000: 192 keys a split) and a CTA walking several splits."""
    from infero.backends.cuda import attention, runtime

    if runtime.context().info.max_shared_per_block_optin < attention.tile_shared_bytes(256, 2):
        pytest.skip("this GPU runs the one-stage kernels only")
    case = make_case(MIXED, config, seed=31)
    decodes = make_case([(1, n) for n in (17, 300, 5000, 20000)], config, seed=37)
    two = run_gpu(case), run_gpu(decodes)
    monkeypatch.setattr(attention, "_stages", lambda head_dim: 1)
    one = run_gpu(case)
    check(f"one stage mixed {config}", one, reference(case))
    assert_bitwise(f"mixed {config} one stage vs two", one, two[0])
    assert_bitwise(f"decode {config} one stage vs two", run_gpu(decodes), two[1])
    monkeypatch.setattr(attention, "DECODE_CTAS_PER_SM", 0)
    assert_bitwise(f"decode {config} one stage, one CTA per sequence vs two stages", run_gpu(decodes), two[1])
