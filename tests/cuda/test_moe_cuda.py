"""The mixture-of-experts ops on the GPU (CudaOps.moe_route, CudaOps.moe_experts: kernels/moe.cu and matvec.cu's
matvec_experts) against the numpy ops, and what a MoE model compiles.

moe_route: the same experts as numpy's except where two probabilities are within fp32 rounding of each other, and
the weights to ~1e-6. moe_experts: within 1e-3 relative of numpy on the dequantized experts (the int8 activation
planes, twice: the hidden state and the SwiGLU output; test_matvec.py bounds one mat-vec at 1e-3), and bitwise
batch invariant: a token's output row is the same bits alone as among 8 or 64 tokens. Each pair's expert mat-vec is
bitwise the plain 1-token mat-vec of that expert's matrix where both run the same arithmetic (matvec_q, matvec_f).
A tiny qwen3moe model tracks the CPU backend whole, in chunks and decoding; a sequence decoding beside seven others
gets the bits it gets alone; graph replay gives eager's bits.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize
from helpers import assert_graph_replay_is_eager, teacher_forced_logits
from helpers import relative_error as rel_err
from tiny_gguf import encode_weight

from infero.backends.cpu.ops import CpuOps

HIDDEN, EXPERT_FFN = 512, 256
# What llama-quantize writes for MoE files (Q4_K_M's Q4_K gate/up and Q6_K down, Q5_K_M, Q8_0), the 32-element
# formats and the float types.
TYPES = [Q.Q4_K, Q.Q6_K, Q.Q5_K, Q.Q8_0, Q.Q4_0, Q.Q3_K, Q.IQ4_XS, Q.F16, Q.F32]
TOKEN_COUNTS = (1, 8, 64)
EXPERTS_BOUND = 1e-3


@functools.cache
def expert_case(qtype: Q, experts: int, rows: int, cols: int, seed: int):
    """(raw GGUF bytes uint8 [experts x rows, row_bytes], float32 dequantized [experts, rows, cols])."""
    rng = np.random.default_rng(seed)
    data, _ = encode_weight(rng.normal(0, 0.05, size=(experts * rows, cols)).astype(np.float32), qtype, rng)
    raw = np.ascontiguousarray(data).view(np.uint8).reshape(experts * rows, -1)
    w = np.asarray(dequantize(raw, qtype), np.float32).reshape(experts, rows, cols)
    return raw, w


def gpu_ops(prepared: bool = True):
    """CudaOps over a workspace of its own; prepared: with the decode activation buffers (as a model's)."""
    from infero.backends.cuda import runtime
    from infero.backends.cuda.ops import CudaOps
    from infero.backends.cuda.tensor import Workspace

    backend = SimpleNamespace(workspace=Workspace(256 << 20), stream=runtime.stream(), weights_arena=None)
    ops = CudaOps(backend)
    if prepared:
        ops.prepare(SimpleNamespace(hidden_size=HIDDEN, q_size=HIDDEN, intermediate_size=EXPERT_FFN,
                                    ssm_inner_size=0, shared_expert_intermediate_size=0))  # fmt: skip
    return ops


def upload_experts(qtype: Q, experts: int, rows: int, cols: int, seed: int):
    from infero.backends.cuda import moe

    raw, w = expert_case(qtype, experts, rows, cols, seed)
    return moe.upload(raw, int(qtype), experts, rows, cols), w


def routed(n: int, experts: int, k: int, seed: int):
    """h [n, HIDDEN] and numpy's routing of it through a random router: (h, router, ids int64, weights)."""
    rng = np.random.default_rng(seed)
    h = rng.normal(0, 1, size=(n, HIDDEN)).astype(np.float32)
    router = rng.normal(0, 0.3, size=(experts, HIDDEN)).astype(np.float32)
    ids, weights = CpuOps().moe_route(h, router, k)
    return h, router, ids, weights


def run_route(ops, h: np.ndarray, router: np.ndarray, k: int):
    from infero.backends.cuda import weight_layout
    from infero.backends.cuda.tensor import from_host

    ops.ws.reset()
    router_w = weight_layout.upload(router.view(np.uint8), int(Q.F32), *router.shape)
    ids, weights = ops.moe_route(from_host(h), router_w, k)
    return ids.to_host(ops.stream), weights.to_host(ops.stream)


def run_experts(ops, h, ids, weights, mats) -> np.ndarray:
    from infero.backends.cuda.tensor import from_host

    ops.ws.reset()
    h_dev = from_host(h)
    out = ops.moe_experts(h_dev, from_host(ids.astype(np.int32)), from_host(weights.astype(np.float32)), *mats)
    return out.to_host(ops.stream)


@pytest.mark.gpu
@pytest.mark.parametrize("experts, k", [(8, 2), (128, 8), (8, 8), (512, 10)])
@pytest.mark.parametrize("n", TOKEN_COUNTS)
def test_route_picks_numpys_experts_and_weights(gpu, experts, k, n):
    h, router, ref_ids, ref_weights = routed(n, experts, k, seed=experts + n)
    ids, weights = run_route(gpu_ops(), h, router, k)
    assert ids.dtype == np.int32 and ids.shape == (n, k) and weights.shape == (n, k)
    probs = CpuOps().linear(h, router)
    probs = np.exp(probs - probs.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    for t in range(n):
        assert len(set(ids[t])) == k and (0 <= ids[t]).all() and (ids[t] < experts).all()
        if not np.array_equal(ids[t], ref_ids[t]):  # only where two probabilities are within rounding
            gaps = np.abs(probs[t, ids[t]] - probs[t, ref_ids[t]])
            assert gaps.max() < 1e-6, f"token {t}: {ids[t]} against numpy's {ref_ids[t]}"
        else:
            np.testing.assert_allclose(weights[t], ref_weights[t], rtol=1e-5, atol=1e-7)
        assert abs(float(weights[t].sum()) - 1) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 4, 17, 64])  # the router's own top-k (up to 4 tokens), then moe_route
def test_a_folded_shared_expert_is_each_tokens_last_pair_weighted_by_its_sigmoid_gate(gpu, n):
    """Qwen3.5-MoE's shared expert folded in: the router's last row is its gate; each token gets the numpy routing
    over the other rows, then (experts, sigmoid(gate))."""
    from infero.backends.cuda import weight_layout
    from infero.backends.cuda.tensor import from_host

    experts, k = 256, 8
    rng = np.random.default_rng(n)
    h = rng.normal(0, 1, size=(n, HIDDEN)).astype(np.float32)
    router = rng.normal(0, 0.3, size=(experts + 1, HIDDEN)).astype(np.float32)
    ref_ids, ref_weights = CpuOps().moe_route(h, router, k, shared=True)
    ops = gpu_ops()
    router_w = weight_layout.upload(router.view(np.uint8), int(Q.F32), *router.shape)
    ids_d, weights_d = ops.moe_route(from_host(h), router_w, k, shared=True)
    ids, weights = ids_d.to_host(ops.stream), weights_d.to_host(ops.stream)
    assert ids.shape == weights.shape == (n, k + 1) and (ids[:, k] == experts).all()
    np.testing.assert_allclose(weights[:, k], ref_weights[:, k], rtol=1e-5)
    for t in range(n):
        assert len(set(ids[t])) == k + 1 and (ids[t, :k] < experts).all()
        if np.array_equal(ids[t], ref_ids[t]):
            np.testing.assert_allclose(weights[t, :k], ref_weights[t, :k], rtol=1e-5, atol=1e-7)


@pytest.mark.gpu
@pytest.mark.parametrize("experts, k, hidden", [(128, 8, 2048), (60, 4, 516), (512, 10, 64), (4096, 8, 64)])
def test_router_rows_are_the_same_bits_at_every_width_and_route_in_the_same_launch(gpu, experts, k, hidden):
    """moe.router's logits row of a token is the same bits among 1, 3, 5, 17, 64 or 203 rows (and within 1e-5 of
    numpy's float64 dot), from moe_router up to ROUTER_TILES_MIN_TOKENS rows and moe_router_tiles past it; routing
    in the router's launch (up to ROUTER_WARPS rows) writes what moe.route writes from those logits; a replayed
    launch (its done-counter back at 0) routes again."""
    from infero.backends.cuda import moe, runtime, weight_layout
    from infero.backends.cuda.tensor import empty, from_host

    rng = np.random.default_rng(experts)
    h = rng.normal(0, 1, size=(203, hidden)).astype(np.float32)
    w = rng.normal(0, 0.3, size=(experts, hidden)).astype(np.float32)
    stream, router = runtime.stream(), weight_layout.upload(w.view(np.uint8), int(Q.F32), experts, hidden)
    hd = from_host(h)

    def logits_of(n: int, routed=None):
        out = empty((n, experts), np.float32)
        moe.router(out, hd.rows(0, n), router, stream, routed)
        return out

    assert 5 < moe.ROUTER_TILES_MIN_TOKENS <= 17
    rows = {n: logits_of(n).to_host(stream) for n in (1, 3, 5, 17, 64, 203)}
    ref = h.astype(np.float64) @ w.T.astype(np.float64)
    assert np.abs(rows[203] - ref).max() < 1e-5 * np.abs(ref).max()
    for n in (1, 3, 5, 17, 64):
        assert np.array_equal(rows[n], rows[203][:n]), f"{n} rows"
    for _ in range(2):
        n = moe.ROUTER_WARPS
        ids, weights = empty((n, k), np.int32), empty((n, k), np.float32)
        logits = logits_of(n, (ids, weights))
        apart = empty((n, k), np.int32), empty((n, k), np.float32)
        moe.route(*apart, logits, stream)
        assert np.array_equal(ids.to_host(stream), apart[0].to_host(stream))
        assert np.array_equal(weights.to_host(stream), apart[1].to_host(stream))


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16], ids=lambda q: q.name)
def test_a_half_precision_router_routes_as_numpy_at_every_width(gpu, qtype):
    """An F16 / BF16 router (not what converters write, but a valid file) runs the fp32 mat-vec 16 rows a launch at
    every width: 64 rows route as numpy routes the same dequantized router, and each row as it does alone."""
    from infero.backends.cuda import weight_layout
    from infero.backends.cuda.tensor import from_host

    experts, k, n = 128, 8, 64
    h, router32, _, _ = routed(n, experts, k, seed=int(qtype))
    raw, _ = encode_weight(router32, qtype, np.random.default_rng(0))
    router = np.asarray(dequantize(np.ascontiguousarray(raw).view(np.uint8), qtype), np.float32).reshape(experts, -1)
    ref_ids, ref_weights = CpuOps().moe_route(h, router, k)
    ops = gpu_ops()
    ops.ws.reset()
    weight = weight_layout.upload(np.ascontiguousarray(raw).view(np.uint8), int(qtype), experts, HIDDEN)
    ids, weights = (t.to_host(ops.stream) for t in ops.moe_route(from_host(h), weight, k))
    agree = [t for t in range(n) if np.array_equal(ids[t], ref_ids[t])]
    assert len(agree) >= n - 2  # a near tie may order two experts the other way
    np.testing.assert_allclose(weights[agree], ref_weights[agree], rtol=1e-5, atol=1e-7)
    ops.ws.reset()
    alone = ops.moe_route(from_host(h[5:6]), weight, k)[0].to_host(ops.stream)
    assert np.array_equal(alone[0], ids[5])


@pytest.mark.gpu
def test_route_breaks_ties_toward_the_lower_expert_id(gpu):
    """Equal router rows give equal probabilities: the lower ids win, in id order, on every row."""
    rng = np.random.default_rng(5)
    router = np.repeat(rng.normal(0, 0.3, size=(4, HIDDEN)).astype(np.float32), 4, axis=0)  # 16 experts, 4 tied
    h = rng.normal(0, 1, size=(8, HIDDEN)).astype(np.float32)
    ids, _ = run_route(gpu_ops(), h, router, 6)
    ref_ids, _ = CpuOps().moe_route(h, router, 6)
    assert np.array_equal(ids, ref_ids)
    for row in ids:  # within each group of 4 equal experts, the lower ids come first
        for group in range(4):
            members = [e for e in row if e // 4 == group]
            assert members == sorted(members) and members == list(range(4 * group, 4 * group + len(members)))


def expert_mats(gate_type: Q, down_type: Q, experts: int):
    gate, wg = upload_experts(gate_type, experts, EXPERT_FFN, HIDDEN, 1)
    up, wu = upload_experts(gate_type, experts, EXPERT_FFN, HIDDEN, 2)
    down, wd = upload_experts(down_type, experts, HIDDEN, EXPERT_FFN, 3)
    return (gate, up, down), (wg, wu, wd)


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_experts_match_numpy_and_are_batch_invariant(gpu, qtype):
    experts, k = 8, 2
    mats, ws = expert_mats(qtype, qtype, experts)
    h, _, ids, weights = routed(max(TOKEN_COUNTS), experts, k, seed=int(qtype))
    ids[3] = ids[4] = [5, 1]  # two tokens sharing both experts, in different ranks than a third
    ids[5] = [1, 5]
    ops = gpu_ops()
    outs = {n: run_experts(ops, h[:n], ids[:n], weights[:n], mats) for n in TOKEN_COUNTS}
    ref = CpuOps().moe_experts(h, ids, weights, *ws)
    err = rel_err(outs[64], ref)
    print(f"{qtype.name}: rel err {err:.2e}")
    assert np.isfinite(outs[64]).all() and err < EXPERTS_BOUND
    for n in TOKEN_COUNTS[:-1]:
        assert np.array_equal(outs[n], outs[64][:n]), f"{n} tokens: not the bits of the same rows among 64"
    alone = np.concatenate([run_experts(ops, h[t : t + 1], ids[t : t + 1], weights[t : t + 1], mats) for t in range(8)])
    assert np.array_equal(alone, outs[8])


@pytest.mark.gpu
def test_mixed_expert_types_and_one_expert_for_every_token(gpu):
    """Q4_K_M's layers of Q4_K gate / up and Q6_K down; every token routed to expert 7 first, experts 0-5 to none;
    k = 1 and k = all experts."""
    experts = 8
    mats, ws = expert_mats(Q.Q4_K, Q.Q6_K, experts)
    ops = gpu_ops(prepared=False)  # every activation quantized into the workspace
    for k in (1, 2, experts):
        h, _, ids, weights = routed(16, experts, k, seed=40 + k)
        if k == 2:
            ids[:] = [7, 6]
        out = run_experts(ops, h, ids, weights, mats)
        err = rel_err(out, CpuOps().moe_experts(h, ids, weights, *ws))
        print(f"k = {k}: rel err {err:.2e}")
        assert err < EXPERTS_BOUND


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q5_K, Q.Q6_K, Q.IQ4_XS, Q.F32, Q.BF16], ids=lambda q: q.name)
def test_each_pair_is_bitwise_the_plain_mat_vec_of_its_expert(gpu, qtype):
    """expert_matvec's row p is the 1-token mat-vec of expert ids[p] on activation row p // per_token: bitwise
    matvec's (these types and widths run matvec_q, or matvec_f, there), NaN-poisoned outputs all written."""
    from infero.backends.cuda import driver, matvec, moe, runtime
    from infero.backends.cuda.tensor import Workspace, empty, from_host

    experts, k, rows, cols = 6, 3, 300, 512
    mat, _ = upload_experts(qtype, experts, rows, cols, 9)
    rng = np.random.default_rng(11)
    x = rng.normal(0, 1, size=(5, cols)).astype(np.float32)
    ids = rng.integers(0, experts, size=5 * k).astype(np.int32)
    stream, ws = runtime.stream(), Workspace(1 << 24)
    xd = from_host(x)
    out = empty((5 * k, rows), np.float32)
    driver.memset_d8(out.ptr, 0xFF, out.nbytes, stream)
    quantized = None
    if qtype not in (Q.F32, Q.F16, Q.BF16):
        quantized = (ws.empty(matvec.activation_shapes(5, cols)[0], np.int8),
                     ws.empty(matvec.activation_shapes(5, cols)[1], np.int32))  # fmt: skip
        matvec.quantize(*quantized, xd, stream)
    moe.expert_matvec([out], [mat], from_host(ids), k, stream, xd, quantized)
    got = out.to_host(stream)
    for p, e in enumerate(ids):
        plain = empty((1, rows), np.float32)
        matvec.matvec(plain, mat.expert(int(e)), xd.rows(p // k, p // k + 1), None, stream, ws)
        assert np.array_equal(got[p], plain.to_host(stream)[0]), f"pair {p} (expert {e})"


def _sorted_pairs(ids: np.ndarray, experts: int, run: int | None = None):
    """moe.sort of ids on the GPU in runs of `run` pairs (moe.GROUP_TOKENS): (grouping on the device, order, groups
    [num_groups, 4]) on the host."""
    from infero.backends.cuda import moe, runtime
    from infero.backends.cuda.tensor import empty, from_host

    stream, pairs, run = runtime.stream(), ids.size, run or moe.GROUP_TOKENS
    grouping = moe.Grouping(empty((pairs,), np.int32), empty((moe.max_groups(pairs, experts, run), 4), np.int32),
                            empty((1,), np.int32), run)  # fmt: skip
    moe.sort(grouping, from_host(ids.reshape(-1).astype(np.int32)), experts, stream)
    count = int(grouping.num_groups.to_host(stream)[0])
    return grouping, grouping.order.to_host(stream), grouping.groups.to_host(stream)[:count]


@pytest.mark.gpu
@pytest.mark.parametrize("experts", [128, 4096])  # 4096: past the default 48 KiB of shared memory
@pytest.mark.parametrize("skew", ["uniform", "one expert for all"])
@pytest.mark.parametrize("run", [8, 64])  # the __dp4a kernel's groups, the tensor-core kernel's largest
def test_sort_lists_every_pair_once_in_runs_of_its_expert(gpu, skew, experts, run):
    rng = np.random.default_rng(3)
    pairs = 64 * 8
    ids = rng.integers(0, experts, size=pairs) if skew == "uniform" else np.full(pairs, 77)
    _, order, groups = _sorted_pairs(ids, experts, run)
    assert sorted(order) == list(range(pairs))
    counts = np.bincount(ids, minlength=experts)
    want = [(e, c) for e in range(experts) for c in [min(run, counts[e] - a) for a in range(0, counts[e], run)]]
    assert [(g[0], g[2]) for g in groups] == want
    covered = np.concatenate([order[g[1] : g[1] + g[2]] for g in groups])
    assert sorted(covered) == list(range(pairs)) and all((ids[order[g[1] : g[1] + g[2]]] == g[0]).all() for g in groups)


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q5_K, Q.Q8_0, Q.Q4_0, Q.Q3_K, Q.IQ4_XS], ids=lambda q: q.name)
def test_grouped_pairs_are_bitwise_each_pairs_own_mat_vec(gpu, qtype):
    """grouped_matvec's row p is expert_matvec's, bit for bit: pairs of one expert in full and short groups (one
    expert taken by 40 of 50 tokens), experts nobody chose, gate + up in one launch and down (per_token 1);
    NaN-poisoned outputs all written."""
    assert_grouped_rows_are_each_pairs(qtype, cols=512, n=50, taken=40)


def assert_grouped_rows_are_each_pairs(qtype: Q, cols: int, n: int, taken: int, run: int | None = None) -> None:
    """grouped_matvec (sorted in runs of `run` pairs, or the sort's default) against expert_matvec, bitwise: 12
    experts of 300 rows, 3 a token, expert 4 taken by the first `taken` tokens, experts 9-11 by none; gate + up in
    one launch and down (per_token 1); NaN-poisoned outputs all written."""
    from infero.backends.cuda import driver, matvec, moe, runtime
    from infero.backends.cuda.tensor import Workspace, empty, from_host

    experts, k, rows = 12, 3, 300
    gate, _ = upload_experts(qtype, experts, rows, cols, 9)
    up, _ = upload_experts(qtype, experts, rows, cols, 10)
    rng = np.random.default_rng(12)
    x = rng.normal(0, 1, size=(n * k, cols)).astype(np.float32)
    ids = rng.integers(0, 9, size=(n, k)).astype(np.int32)  # experts 9-11: nobody's
    ids[:taken, 0] = 4
    stream, ws = runtime.stream(), Workspace(1 << 26)
    grouping, _, groups = _sorted_pairs(ids, experts, run)
    if run is not None:
        assert groups[:, 2].max() == run and (groups[:, 2] < run).any()  # full and short groups
    xd = from_host(x)
    for per_token, mats in ((k, [gate, up]), (1, [gate])):
        act_rows = n * k // per_token
        quantized = (ws.empty(matvec.activation_shapes(act_rows, cols)[0], np.int8),
                     ws.empty(matvec.activation_shapes(act_rows, cols)[1], np.int32))  # fmt: skip
        matvec.quantize(*quantized, xd.rows(0, act_rows), stream)
        outs = {}
        for how in ("pairs", "grouped"):
            outs[how] = [empty((n * k, rows), np.float32) for _ in mats]
            for o in outs[how]:
                driver.memset_d8(o.ptr, 0xFF, o.nbytes, stream)
            if how == "pairs":
                moe.expert_matvec(outs[how], mats, from_host(ids.reshape(-1)), per_token, stream, None, quantized)
            else:
                moe.grouped_matvec(outs[how], mats, grouping, per_token, stream, quantized)
        for a, b in zip(outs["pairs"], outs["grouped"], strict=True):
            a, b = a.to_host(stream), b.to_host(stream)
            assert np.isfinite(b).all() and np.array_equal(a, b), f"per_token {per_token}"


# Rows of 24 units (lanes 24-31 hold none) and 64 (two a lane) for every type; 25 for Q8_0, whose rows need not be
# whole 256-element superblocks.
TENSOR_CORE_ROWS = [(q, c) for q in (Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q8_0) for c in (768, 2048)] + [(Q.Q8_0, 800)]


@pytest.mark.gpu
@pytest.mark.parametrize("group", [16, 32, 64], ids=lambda g: f"G{g}")
@pytest.mark.parametrize("qtype, cols", TENSOR_CORE_ROWS, ids=lambda v: getattr(v, "name", f"cols{v}"))
def test_tensor_core_groups_are_bitwise_each_pairs_own_mat_vec(gpu, qtype, group, cols):
    """matvec_experts_mma's row p is expert_matvec's (matvec_q at one token), bit for bit, for runs of 16, 32 and 64
    pairs: full and short groups (one expert taken by 70 of 80 tokens), experts nobody chose, gate + up in one launch
    and down (per_token 1), rows that leave a block's tile short; rows of 24 units (lanes 24-31 hold none), 64 (two a
    lane) and, Q8_0 only, 25; NaN-poisoned outputs all written."""
    assert_grouped_rows_are_each_pairs(qtype, cols=cols, n=80, taken=70, run=group)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [8, 64, 512])
@pytest.mark.parametrize("gate_type, down_type", [(Q.Q4_K, Q.Q6_K), (Q.Q4_K, Q.Q4_K), (Q.Q5_K, Q.Q5_K),
                                                  (Q.Q6_K, Q.Q6_K), (Q.Q8_0, Q.Q8_0)],
                         ids=lambda q: q.name)  # fmt: skip
def test_moe_experts_on_the_tensor_cores_are_the_bits_of_every_other_path(gpu, monkeypatch, gate_type, down_type, n):
    """A layer of 128 experts, k = 8, at 8, 64 and 512 tokens: its output is the same bits pair by pair, grouped
    on the __dp4a kernel, and grouped on the tensor cores in runs of 16, 32 and 64 pairs (so MOE_MMA_MIN_TOKENS can
    change no token's bits)."""
    from infero.backends.cuda import moe
    from infero.backends.cuda import ops as cuda_ops

    mats, _ = expert_mats(gate_type, down_type, 128)
    h, _, ids, weights = routed(n, 128, 8, seed=n + int(gate_type))
    ops = gpu_ops(prepared=False)
    paths = {"pairs": (n + 1, n + 1, moe.MMA_GROUP), "dp4a": (2, n + 1, moe.MMA_GROUP)}
    paths |= {f"mma{g}": (2, 1, g) for g in moe.MMA_GROUPS}
    outs = {}
    for name, (grouped_from, mma_from, group) in paths.items():
        monkeypatch.setattr(cuda_ops, "MOE_GROUPED_MIN_TOKENS", grouped_from)
        monkeypatch.setattr(cuda_ops, "MOE_MMA_MIN_TOKENS", mma_from)
        monkeypatch.setattr(moe, "MMA_GROUP", group)
        outs[name] = run_experts(ops, h, ids, weights, mats)
    assert np.isfinite(outs["pairs"]).all()
    for name, out in outs.items():
        assert np.array_equal(out, outs["pairs"]), name


@pytest.mark.gpu
@pytest.mark.parametrize("k", [1, 3, 9, 16])
@pytest.mark.parametrize("qtype", [Q.Q6_K, Q.Q4_K, Q.Q8_0, Q.Q5_0], ids=lambda q: q.name)
def test_down_and_combine_in_one_launch_are_bitwise_the_two_launches(gpu, qtype, k):
    from infero.backends.cuda import driver, matvec, moe, runtime
    from infero.backends.cuda.tensor import Workspace, empty, from_host

    experts, rows, cols, n = 20, 300, 256, 3
    down, _ = upload_experts(qtype, experts, rows, cols, 21)
    rng = np.random.default_rng(k)
    x = rng.normal(0, 1, size=(n * k, cols)).astype(np.float32)
    ids = np.stack([rng.permutation(experts)[:k] for _ in range(n)]).astype(np.int32)
    weights = rng.dirichlet(np.ones(k), size=n).astype(np.float32)
    stream, ws = runtime.stream(), Workspace(1 << 24)
    quantized = (ws.empty(matvec.activation_shapes(n * k, cols)[0], np.int8),
                 ws.empty(matvec.activation_shapes(n * k, cols)[1], np.int32))  # fmt: skip
    matvec.quantize(*quantized, from_host(x), stream)
    ids_d, weights_d = from_host(ids), from_host(weights)
    y, apart, fused = empty((n * k, rows), np.float32), empty((n, rows), np.float32), empty((n, rows), np.float32)
    driver.memset_d8(fused.ptr, 0xFF, fused.nbytes, stream)
    moe.expert_matvec([y], [down], ids_d.reshape(n * k), 1, stream, None, quantized)
    moe.combine(apart, y, weights_d, stream)
    moe.down_combine(fused, down, ids_d, weights_d, quantized, stream)
    got = fused.to_host(stream)
    assert np.isfinite(got).all() and np.array_equal(got, apart.to_host(stream))


def test_a_moe_model_compiles_its_types_expert_kernels_and_a_dense_one_none():
    import importlib
    import pkgutil

    import infero.backends.cuda as cuda_pkg
    from infero.backends.cuda import runtime

    for module in pkgutil.iter_modules(cuda_pkg.__path__):
        importlib.import_module(f"infero.backends.cuda.{module.name}")

    def names(experts: bool, types=(Q.Q4_K, Q.Q6_K, Q.F32)) -> set[str]:
        units = runtime.needed_units(runtime.model_needs(128, types, experts))
        return {f"{u.filename}: {name}" for u, ns in units.items() for name in ns}

    from infero.backends.cuda.moe import COMBINE_RPW, PAIR_RPW

    moe_names, dense_names = names(True), names(False)
    assert {"moe.cu: moe_route", "moe.cu: moe_router", "moe.cu: moe_combine", "moe.cu: moe_sort",
            f"matvec.cu: matvec_experts<12, {PAIR_RPW}>",
            "matvec.cu: matvec_experts_grouped<14, 8, 2>", f"matvec.cu: matvec_experts_combine<14, {COMBINE_RPW}>",
            f"matvec.cu: matvec_experts<14, {PAIR_RPW}>", "matvec.cu: matvec_experts_f<0>"} <= moe_names  # fmt: skip
    assert not [n for n in moe_names if "matvec_experts<8," in n or "matvec_experts_f<1>" in n]
    # A dense model's float32 matrices of few rows take the router's mat-vec (CudaOps.linear), nothing else of MoE.
    assert sorted(n for n in dense_names if "moe.cu" in n or "experts" in n) == [
        "moe.cu: moe_router",
        "moe.cu: moe_router_tiles",
    ]
    assert not [n for n in names(False, (Q.Q4_K, Q.Q6_K)) if "moe.cu" in n or "experts" in n]


def test_bench_decode_counts_the_bytes_of_the_experts_a_token_reads():
    """bench decode's byte count walks a layer's weights: expert tensors count their GGUF bytes times k / experts
    (what one token's step reads of them), the router and every other tensor whole."""
    from infero.backends.cuda import moe
    from infero.backends.cuda.tensor import QuantWeight
    from infero.bench.decode import _weight_bytes

    gate = moe.ExpertWeights(QuantWeight(None, int(Q.Q4_K), 8 * 768, 2048), 8)
    down = moe.ExpertWeights(QuantWeight(None, int(Q.Q6_K), 8 * 2048, 768), 8)
    router = QuantWeight(None, int(Q.F32), 8, 2048)
    layer = SimpleNamespace(gate_exps=gate, down_exps=down, router=router)
    every = 8 * 768 * 8 * 144 + 8 * 2048 * 3 * 210
    assert _weight_bytes(layer) == every + 8 * 2048 * 4
    assert _weight_bytes(layer, 2 / 8) == every // 4 + 8 * 2048 * 4


class _Tensor:
    def __init__(self, ptr: int, shape, dtype):
        self.ptr, self.shape, self.dtype = ptr, tuple(shape), np.dtype(dtype)

    def reshape(self, *shape):
        return _Tensor(self.ptr, shape, self.dtype)


class _Workspace:
    """Hands out distinct addresses; offset counts allocations (ops.moe_experts must hand its pairs' buffers back)."""

    generation = 0

    def __init__(self):
        self.offset = 0

    def empty(self, shape, dtype):
        self.offset += 1
        return _Tensor(self.offset << 20, shape, dtype)


def _experts(t: Q, experts: int, rows: int, cols: int):
    from infero.backends.cuda import moe

    matrix = SimpleNamespace(
        ggml_type=int(t), rows=experts * rows, cols=cols, data=SimpleNamespace(shape=(experts * rows, cols))
    )
    return moe.ExpertWeights(matrix, experts)


@pytest.fixture
def launches(monkeypatch):
    """(ops over a fake workspace, the launches moe_experts queues, in order). No GPU: launchers are recorders."""
    from infero.backends.cuda import elementwise, matvec, moe
    from infero.backends.cuda.ops import CudaOps

    calls = []
    monkeypatch.setattr(matvec, "quantize", lambda q, s, x, stream: calls.append(("quantize", x.ptr, q.shape)))
    monkeypatch.setattr(elementwise, "swiglu", lambda out, gate, up, stream, quantized=None: calls.append(
        ("swiglu", out.ptr, gate.ptr, up.ptr, quantized)))  # fmt: skip
    monkeypatch.setattr(moe, "expert_matvec", lambda outs, mats, ids, per_token, stream, x, quantized: calls.append(
        ("experts", [o.ptr for o in outs], [m.ggml_type for m in mats], per_token, x.ptr, quantized)))  # fmt: skip
    monkeypatch.setattr(moe, "sort", lambda grouping, ids, experts, stream: calls.append(
        ("sort", grouping, ids.ptr, experts)))  # fmt: skip
    monkeypatch.setattr(moe, "grouped_matvec", lambda outs, mats, grouping, per_token, stream, quantized: calls.append(
        ("grouped", [o.ptr for o in outs], [m.ggml_type for m in mats], per_token, grouping, quantized)))  # fmt: skip
    monkeypatch.setattr(moe, "combine", lambda out, y, w, stream: calls.append(("combine", out.ptr, y.ptr, w.ptr)))
    monkeypatch.setattr(moe, "down_combine", lambda out, down, ids, w, quantized, stream: calls.append(
        ("down_combine", out.ptr, down.ggml_type, ids.ptr, w.ptr, quantized)))  # fmt: skip
    return CudaOps(SimpleNamespace(workspace=_Workspace(), stream=None, weights_arena=None)), calls


def test_moe_experts_sorts_pairs_once_and_runs_grouped_gate_up_swiglu_down_combine(launches, monkeypatch):
    """32 tokens (more than the decode buffers hold) on the __dp4a groups: h quantized once into the workspace; the
    pairs sorted by expert once (groups sized for 32 x 4 pairs of 8 experts); Q4_K gate and up in one grouped launch
    reading h; SwiGLU into gate, quantized for the Q6_K down, grouped by the same sort; the combine reads down's
    output; every buffer but the output handed back."""
    from infero.backends.cuda import moe
    from infero.backends.cuda import ops as cuda_ops

    ops, calls = launches
    n, k = 32, 4
    monkeypatch.setattr(cuda_ops, "MOE_MMA_MIN_TOKENS", n + 1)
    h, ids, weights = _Tensor(1, (n, 256), np.float32), _Tensor(2, (n, k), np.int32), _Tensor(3, (n, k), np.float32)
    mats = (_experts(Q.Q4_K, 8, 128, 256), _experts(Q.Q4_K, 8, 128, 256), _experts(Q.Q6_K, 8, 256, 128))
    out = ops.moe_experts(h, ids, weights, *mats)
    assert out.shape == (n, 256) and ops.ws.offset == 1  # the output alone stays
    sort, quantize, gate_up, swiglu, down, combine = calls
    grouping = sort[1]
    assert sort[2:] == (ids.ptr, 8) and grouping.order.shape == (n * k,) and grouping.run == moe.GROUP_TOKENS == 8
    assert grouping.groups.shape == (moe.max_groups(n * k, 8, 8), 4) == (16 + 8, 4)
    assert quantize[:2] == ("quantize", h.ptr) and quantize[2] == (2, n, 256)
    (gate, up), h_quantized = gate_up[1], gate_up[5]
    assert gate_up[0] == "grouped" and gate_up[2:5] == ([12, 12], k, grouping) and h_quantized[0].shape == (2, n, 256)
    assert swiglu[1:4] == (gate, gate, up) and swiglu[4][0].shape == (2, n * k, 128)
    assert down[0] == "grouped" and down[2:5] == ([14], 1, grouping) and down[5] is swiglu[4]
    assert combine[1:] == (out.ptr, down[1][0], weights.ptr)


def test_moe_experts_sorts_for_the_tensor_cores_from_a_token_count_if_every_type_takes_them(launches, monkeypatch):
    """From MOE_MMA_MIN_TOKENS tokens a layer of moe.MMA_TYPES sorts its pairs in runs of moe.MMA_GROUP (groups sized
    for them) and both grouped launches read that grouping; below it, or with a Q3_K down, runs of GROUP_TOKENS."""
    from infero.backends.cuda import moe
    from infero.backends.cuda import ops as cuda_ops

    ops, calls = launches
    monkeypatch.setattr(cuda_ops, "MOE_MMA_MIN_TOKENS", 16)
    n, k = 16, 4
    ids, weights = _Tensor(2, (n, k), np.int32), _Tensor(3, (n, k), np.float32)
    q4k_q6k = (_experts(Q.Q4_K, 8, 128, 256), _experts(Q.Q4_K, 8, 128, 256), _experts(Q.Q6_K, 8, 256, 128))
    q4k_q3k = (*q4k_q6k[:2], _experts(Q.Q3_K, 8, 256, 128))
    for tokens, mats, run in ((n, q4k_q6k, moe.MMA_GROUP), (n - 1, q4k_q6k, 8), (n, q4k_q3k, 8)):
        calls.clear()
        ops.moe_experts(_Tensor(1, (tokens, 256), np.float32), ids.reshape(tokens, k), weights.reshape(tokens, k),
                        *mats)  # fmt: skip
        grouping = calls[0][1]
        assert calls[0][0] == "sort" and grouping.run == run
        assert grouping.groups.shape == (moe.max_groups(tokens * k, 8, run), 4)
        assert [c[4] for c in calls if c[0] == "grouped"] == [grouping, grouping]
    assert moe.MMA_GROUP != moe.GROUP_TOKENS and moe.MMA_GROUP in moe.MMA_GROUPS


def test_one_token_runs_each_pair_on_its_own_expert_and_down_with_the_combine(launches):
    """A decode step of one token: no sort; gate + up pair by pair; SwiGLU quantized for down; down and the combine
    in one launch (k = 8, and 9: Qwen3.5-MoE's eight and its folded shared expert); a k past COMBINE_MAX_K keeps
    them apart."""
    ops, calls = launches
    h, ids, weights = _Tensor(1, (1, 256), np.float32), _Tensor(2, (1, 8), np.int32), _Tensor(3, (1, 8), np.float32)
    mats = [_experts(t, 16, r, c) for t, r, c in ((Q.Q4_K, 128, 256), (Q.Q4_K, 128, 256), (Q.Q6_K, 256, 128))]
    out = ops.moe_experts(h, ids, weights, *mats)
    assert [c[0] for c in calls] == ["quantize", "experts", "swiglu", "down_combine"]
    assert calls[3][1:5] == (out.ptr, 14, ids.ptr, weights.ptr) and calls[3][5] is calls[2][4]
    for k, kinds in ((9, ["down_combine"]), (17, ["experts", "combine"])):
        calls.clear()
        ids, weights = _Tensor(2, (1, k), np.int32), _Tensor(3, (1, k), np.float32)
        ops.moe_experts(h, ids, weights, *mats)
        assert [c[0] for c in calls] == ["quantize", "experts", "swiglu", *kinds]


def test_moe_experts_runs_gate_and_up_of_other_types_apart_and_float_experts_unquantized(launches):
    """Gate and up of two block formats: two grouped launches; an F16 down reads SwiGLU's float32 output pair by
    pair (the grouped kernel is for block formats); all-float experts need no sort."""
    ops, calls = launches
    h, ids, weights = _Tensor(1, (2, 256), np.float32), _Tensor(2, (2, 2), np.int32), _Tensor(3, (2, 2), np.float32)
    ops.moe_experts(h, ids, weights, _experts(Q.Q4_K, 4, 64, 256), _experts(Q.Q5_K, 4, 64, 256),
                    _experts(Q.F16, 4, 256, 64))  # fmt: skip
    kinds = [(c[0], c[2]) if c[0] in ("experts", "grouped") else (c[0],) for c in calls]
    assert kinds == [("sort",), ("quantize",), ("grouped", [12]), ("grouped", [13]), ("swiglu",), ("experts", [1]),
                     ("combine",)]  # fmt: skip
    assert calls[4][4] is None and calls[5][5] is None  # SwiGLU's output read as float32 by the F16 down
    calls.clear()
    ops.moe_experts(h, ids, weights, *(_experts(Q.F32, 4, r, c) for r, c in ((64, 256), (64, 256), (256, 64))))
    assert [c[0] for c in calls] == ["experts", "swiglu", "experts", "combine"]
    assert calls[0][4] == h.ptr and calls[0][5] is None


# ---- a tiny qwen3moe model against the CPU backend ---------------------------------------------------------------

MOE_PROMPT = [(17 * i + 5) % 250 for i in range(64)]
NEAR_TIE = 1e-3  # top-1 may differ only where the reference's top two logits are closer than this


def agrees_on_top1(out, ref) -> bool:
    top2 = np.sort(ref, axis=-1)[:, -2:]
    return bool(np.all((out.argmax(-1) == ref.argmax(-1)) | (top2[:, 1] - top2[:, 0] < NEAR_TIE)))


def moe_file(tmp_path, qtype: Q, **kwargs):
    from tiny_moe import write_tiny_moe

    return write_tiny_moe(tmp_path / f"moe-{qtype.name}.gguf", qtype=qtype, seed=int(qtype) + 3, head_dim=64, **kwargs)


STEPS = {
    "prefill 64": [(0, 64)],
    "prefill 8 a step": [(a, a + 8) for a in range(0, 64, 8)],
    "chunks of 7": [(a, min(a + 7, 64)) for a in range(0, 64, 7)],
    "decode": [(i, i + 1) for i in range(64)],
}


@pytest.mark.gpu
@pytest.mark.parametrize("source", ["F32", "Q8_0", "Q4_0"])
def test_a_tiny_qwen3moe_tracks_the_cpu_backend_at_every_step_shape(gpu, tmp_path, source):
    from infero import LLM

    path = moe_file(tmp_path, Q[source])
    cpu, cuda = LLM(path, device="cpu"), LLM(path, device="cuda")
    ref = teacher_forced_logits(cpu, MOE_PROMPT, STEPS["prefill 64"])
    for name, steps in STEPS.items():
        out = teacher_forced_logits(cuda, MOE_PROMPT, steps)
        err = rel_err(out, ref)
        print(f"{source}, {name}: rel err {err:.2e}")
        assert np.isfinite(out).all() and err < 2e-2 and agrees_on_top1(out, ref), name


@pytest.mark.gpu
def test_decode_beside_seven_others_is_bitwise_decode_alone(gpu, tmp_path):
    """Q4_0 (every linear of 1-16 tokens on matvec_q, the router on matvec_f, the experts per pair): a sequence's
    decode logits are the same bits whichever and however many sequences share its step."""
    from infero import LLM
    from infero.engine.batch import SequenceStep, build_batch

    llm = LLM(moe_file(tmp_path, Q.Q4_0), device="cuda")
    backend, model = llm.backend, llm.model
    cache = backend.allocate_kv_cache(model.config, 64, 16)
    prompts = [[(7 * i + 13 * j + 1) % 250 for j in range(5 + i)] for i in range(8)]
    tables = [list(range(4 * i, 4 * i + 4)) for i in range(8)]
    for p, table in zip(prompts, tables, strict=True):
        backend.forward(model, build_batch([SequenceStep(p, 0, table)], 16), cache)
    steps = [SequenceStep([(3 * i) % 250], len(p), t) for i, (p, t) in enumerate(zip(prompts, tables, strict=True))]
    together = backend.to_host(backend.forward(model, build_batch(steps, 16), cache), 0, 8)
    for i, step in enumerate(steps):
        alone = backend.to_host(backend.forward(model, build_batch([step], 16), cache), 0, 1)
        assert np.array_equal(alone[0], together[i]), f"sequence {i}"


@pytest.mark.gpu
def test_moe_graph_replay_is_bit_identical_to_eager(gpu, tmp_path):
    prompts = [[3 + i, 50 + 7 * i, 100 + i, 200 - i, 17] for i in range(5)]
    assert_graph_replay_is_eager(moe_file(tmp_path, Q.Q8_0), prompts)


FP16_TYPES = (Q.Q4_K, Q.Q6_K, Q.Q8_0)
FP16_BOUND = 2e-3  # fp16 weights and activations, fp32 sums: as test_skinny_gemm.py's


def fp16_rows(mats, x: np.ndarray, per_token: int, ids: np.ndarray, run: int | None) -> list[np.ndarray]:
    """moe.fp16_experts' outputs for pairs ids (pair p reading row p // per_token of x): sorted into runs of `run`,
    or (None) each pair a group of its own; outputs NaN-poisoned first, so a row left unwritten shows."""
    from infero.backends.cuda import driver, moe, runtime, skinny_gemm
    from infero.backends.cuda.tensor import empty, from_host

    stream, pairs = runtime.stream(), ids.size
    xa = empty(skinny_gemm.activation_rows_shape(*x.shape), np.uint32)
    skinny_gemm.convert(xa, from_host(x), mats[0].ggml_type, stream, rows_layout=True)
    outs = [empty((pairs, m.rows), np.float32) for m in mats]
    for o in outs:
        driver.memset_d8(o.ptr, 0xFF, o.nbytes, stream)
    if run is None:
        moe.fp16_experts(outs, mats, per_token, xa, stream, ids=from_host(ids.astype(np.int32)))
    else:
        grouping, _, _ = _sorted_pairs(ids, mats[0].experts, run)
        moe.fp16_experts(outs, mats, per_token, xa, stream, grouping=grouping)
    return [o.to_host(stream) for o in outs]


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", FP16_TYPES, ids=lambda q: q.name)
def test_fp16_experts_match_float64_and_give_a_pair_the_same_bits_in_any_run(gpu, qtype):
    """skinny_experts (moe.FP16_EXPERTS): every pair's row within FP16_BOUND of float64 on the dequantized expert,
    gate and up in one launch (per_token 3) and down alone (per_token 1, 256 columns); and bitwise the same with
    each pair a group of its own and in runs of 8, 16, 32 and 64 (one expert taken by 40 of 50 tokens, so full and
    short runs; experts nobody chose)."""
    from infero.backends.cuda import moe

    experts, k, n = 8, 3, 50
    gate, wg = upload_experts(qtype, experts, EXPERT_FFN, HIDDEN, 21)
    up, wu = upload_experts(qtype, experts, EXPERT_FFN, HIDDEN, 22)
    down, wd = upload_experts(qtype, experts, HIDDEN, EXPERT_FFN, 23)
    rng = np.random.default_rng(int(qtype))
    x = rng.normal(0, 1, size=(n, HIDDEN)).astype(np.float32)
    ids = rng.integers(0, 6, size=(n, k))
    ids[:40, 0] = 2
    ids = ids.reshape(-1)
    y = rng.normal(0, 1, size=(n * k, EXPERT_FFN)).astype(np.float32)
    cases = [([gate, up], (wg, wu), x, k), ([down], (wd,), y, 1)]
    for mats, ws, act, per_token in cases:
        runs = {run: fp16_rows(mats, act, per_token, ids, run) for run in (None, *moe.FP16_RUNS)}
        for got, w in zip(runs[None], ws, strict=True):
            ref = np.einsum(
                "pc,prc->pr", act[np.arange(n * k) // per_token].astype(np.float64), w[ids].astype(np.float64)
            )
            err = rel_err(got, ref)
            print(f"{qtype.name} {w.shape[1]}x{w.shape[2]}: rel err {err:.2e}")
            assert np.isfinite(got).all() and err < FP16_BOUND
        for run, outs in runs.items():
            for got, want in zip(outs, runs[None], strict=True):
                assert np.array_equal(got, want), f"runs of {run}: a pair's row differs from its own group's"


@pytest.mark.gpu
@pytest.mark.parametrize("experts, k", [(8, 2), (16, 9)])  # 9 pairs a token: a warp of the fused combine takes two
@pytest.mark.parametrize("gate_type, down_type", [(Q.Q4_K, Q.Q6_K), (Q.Q8_0, Q.Q8_0)], ids=["Q4_K-Q6_K", "Q8_0"])
def test_fp16_experts_layer_matches_numpy_and_is_batch_invariant(gpu, monkeypatch, gate_type, down_type, experts, k):
    """CudaOps.moe_experts with moe.FP16_EXPERTS: within FP16_BOUND of numpy, and a token's row the same bits alone
    (each pair its own group, no sort, down and the combine in one launch), among 8 and among 64 tokens (sorted into
    runs; down, then moe_combine)."""
    from infero.backends.cuda import moe

    monkeypatch.setattr(moe, "FP16_EXPERTS", 1)
    mats, ws = expert_mats(gate_type, down_type, experts)
    assert moe.fp16_takes(list(mats))
    h, _, ids, weights = routed(64, experts, k, seed=70)
    ops = gpu_ops()
    outs = {n: run_experts(ops, h[:n], ids[:n], weights[:n], mats) for n in TOKEN_COUNTS}
    err = rel_err(outs[64], CpuOps().moe_experts(h, ids, weights, *ws))
    print(f"{gate_type.name}/{down_type.name}: rel err {err:.2e}")
    assert np.isfinite(outs[64]).all() and err < FP16_BOUND
    for n in TOKEN_COUNTS[:-1]:
        assert np.array_equal(outs[n], outs[64][:n]), f"{n} tokens: not the bits of the same rows among 64"
    alone = np.concatenate([run_experts(ops, h[t : t + 1], ids[t : t + 1], weights[t : t + 1], mats) for t in range(8)])
    assert np.array_equal(alone, outs[8])
