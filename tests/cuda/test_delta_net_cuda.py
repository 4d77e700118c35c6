"""The Gated DeltaNet's kernels (kernels/delta_net.cu through backends/cuda/delta_net.py) against the numpy ops of
CpuOps, and the launchers' refusals (those run without a GPU).

Bounds, all fp32: the conv1d's and the gates' sums are numpy's, rounded step by step as numpy rounds them, so only
expf and log1pf differ (an ulp or two of each element): 1e-6 relative per element. The norms (of q and k, of the
output) sum squares in another order than numpy's pairwise sum (a few ulp of the row's norm): 1e-6 relative. The
delta rule's dot products run in another order than numpy's BLAS (a few ulp of each token's S^T k and S^T q), and
the state carries those through 130 tokens: 1e-5 relative over a sequence's outputs and its final state (each step's
update I - beta k k^T with |k| = 1 and 0 < beta < 1, times a decay below 1, shrinks an earlier error rather than
growing it).

Every output buffer starts as NaN, so an element a kernel leaves unwritten fails the comparison. The delta rule's
inputs (conv1d, q/k norm, gates) and the delta rule are bitwise the same whether a prompt runs in one step or in
steps of 1, 7 or 64 tokens beside another sequence's tokens (the state carried through device memory, read and
written once a step).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from helpers import record_launches
from helpers import relative_error as rel_err
from helpers import stand_in as tensor

from infero.backends.cpu import delta_net as cpu_delta_net
from infero.backends.cpu.ops import CpuOps
from infero.backends.cuda.tensor import columns

FIXTURES = Path(__file__).parent.parent / "fixtures" / "models"
LENGTHS = (1, 7, 64, 130)
SLOTS = (4, 0, 5, 2)  # out of order, with slots 1 and 3 left alone
NUM_SLOTS, LAYERS, LAYER = 6, 2, 1
CONV_KERNEL = 4
ELEMENTWISE_BOUND, NORM_BOUND, RULE_BOUND = 1e-6, 1e-6, 1e-5
# (key heads, value heads, d_k, d_v): Qwen3.5's heads (two key heads for four value heads), half-size heads, and
# the tiny test models'.
RULE_SHAPES = [(2, 4, 128, 128), (1, 2, 64, 64), (2, 4, 16, 32)]


def _dev(a: np.ndarray):
    from infero.backends.cuda.tensor import from_host

    return from_host(np.ascontiguousarray(a))


def _poisoned(shape):
    return _dev(np.full(shape, np.nan, np.float32))


def _host(t) -> np.ndarray:
    from infero.backends.cuda import runtime

    return t.to_host(runtime.stream())


def _stream():
    from infero.backends.cuda import runtime

    return runtime.stream()


def sequences(lengths, slots):
    """The numpy op's batch (query_starts, state_slots) and the device copies the kernels read."""
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    slots = np.asarray(slots, np.int32)
    return SimpleNamespace(query_starts=starts, state_slots=slots), _dev(starts), _dev(slots)


def carried_states(rng, channels: int, v_heads: int, d_k: int, d_v: int, fresh=(0,), slots: int = NUM_SLOTS):
    """conv [slots, layers, C, K - 1] and delta [slots, layers, v_heads, d_k, d_v]: earlier steps' random state in
    every slot but the `fresh` ones (zero, as reset_states leaves a new sequence's)."""
    conv = rng.normal(0, 1, (slots, LAYERS, channels, CONV_KERNEL - 1)).astype(np.float32)
    delta = rng.normal(0, 0.1, (slots, LAYERS, v_heads, d_k, d_v)).astype(np.float32)
    conv[list(fresh)] = 0.0
    delta[list(fresh)] = 0.0
    return conv, delta


def run_split(launch, total: int, chunk: int, other_slot: int, other_lengths):
    """launch(pieces, slots) for each step: this sequence's next `chunk` tokens (slot 1) beside another sequence's
    tokens (other_slot, a different length each step)."""
    for i, lo in enumerate(range(0, total, chunk)):
        other = other_lengths[i % len(other_lengths)]
        launch([(lo, min(lo + chunk, total)), other], [1, other_slot])


# delta_net_inputs

# (key heads, value heads, d_k, d_v): Qwen3.5's heads of 128; heads of 64 whose q | k fill three blocks of 128
# channels and whose channels end inside a block; the tiny models' heads of 16, q | k and v sharing a block.
INPUT_SHAPES = [(2, 4, 128, 128), (3, 6, 64, 32), (2, 4, 16, 32)]
# alpha and beta: two projections; one [alpha | beta] projection read as its columns (qwen35's stacked); Qwen3-Next's
# ba, per key head its betas, then its alphas (alpha None).
LAYOUTS = ["apart", "stacked", "fused"]
PREFILL_LENGTHS = (1, 7, 16, 17, 64, 150)  # one chunk, a part of one, two, and several side by side
PREFILL_SLOTS = (4, 0, 7, 2, 5, 1)  # out of order, with slots 3 and 6 left alone
EPS = 1e-6


class _PoisonedWorkspace:
    """The ops' workspace: every tensor starts as NaN, so an element the kernel leaves unwritten fails."""

    generation = 0

    def empty(self, shape, dtype):
        return _poisoned(shape) if dtype == np.float32 else _dev(np.zeros(shape, dtype))


def layer_inputs(rng, n: int, shape, layout: str):
    """One delta-net layer's projections of n tokens and its weights, on the host; alpha and beta as the op takes
    them in `layout` (with `group` for the fused one)."""
    key_heads, v_heads, d_k, d_v = shape
    channels = 2 * key_heads * d_k + v_heads * d_v
    alpha = rng.normal(0, 4, (n, v_heads)).astype(np.float32)
    alpha[:1, :4] = (0.0, 30.0, -30.0, -0.0)  # softplus at 0 (numpy: log 2), far into both branches
    beta = rng.normal(0, 4, (n, v_heads)).astype(np.float32)
    group = None
    if layout == "stacked":
        ab = np.concatenate([alpha, beta], axis=1)
        alpha, beta = ab[:, :v_heads], ab[:, v_heads:]
    elif layout == "fused":
        group = v_heads // key_heads
        halves = (beta.reshape(n, key_heads, group), alpha.reshape(n, key_heads, group))
        alpha, beta = None, np.stack(halves, axis=2).reshape(n, 2 * v_heads)
    return SimpleNamespace(qkv=rng.normal(0, 1, (n, channels)).astype(np.float32), alpha=alpha, beta=beta,
                           group=group, layout=layout,
                           conv_weight=rng.normal(0, 0.5, (channels, CONV_KERNEL)).astype(np.float32),
                           dt_bias=rng.normal(0, 0.5, v_heads).astype(np.float32),
                           a=-np.exp(rng.normal(0, 1, v_heads)).astype(np.float32))  # fmt: skip


def numpy_inputs(p, shape, conv, lengths, slots):
    """CpuOps.delta_net_inputs' conv output, g and beta, and the conv state it leaves (conv is copied)."""
    key_heads, _, d_k, _ = shape
    batch, _, _ = sequences(lengths, slots)
    cache = SimpleNamespace(conv=conv.copy())
    out = CpuOps().delta_net_inputs(p.qkv, p.alpha, p.beta, p.conv_weight, p.dt_bias, p.a, key_heads, d_k, EPS,
                                    cache, LAYER, batch, p.group)  # fmt: skip
    return (*out, cache.conv)


def gpu_inputs(p, shape, state, lengths, slots):
    """CudaOps.delta_net_inputs' conv output, g and beta on the host; state (device) is updated in place."""
    from infero.backends.cuda.ops import CudaOps

    key_heads, v_heads, d_k, _ = shape
    alpha, beta = (None if p.alpha is None else _dev(p.alpha)), _dev(p.beta)
    if p.layout == "stacked":
        ab = _dev(np.concatenate([p.alpha, p.beta], axis=1))
        alpha, beta = columns(ab, 0, v_heads), columns(ab, v_heads, 2 * v_heads)
    _, starts, slots_d = sequences(lengths, slots)
    batch = SimpleNamespace(query_starts=starts, state_slots=slots_d, max_query_len=max(lengths))
    ops = CudaOps(SimpleNamespace(workspace=_PoisonedWorkspace(), stream=_stream(), weights_arena=None))
    out = ops.delta_net_inputs(_dev(p.qkv), alpha, beta, _dev(p.conv_weight), _dev(p.dt_bias), _dev(p.a),
                               key_heads, d_k, EPS, SimpleNamespace(conv=state), LAYER, batch, p.group)  # fmt: skip
    return tuple(_host(t) for t in out)


def assert_inputs_match(got, expected, normed: int):
    out, g, beta = got
    expected_out, expected_g, expected_beta = expected[:3]
    assert np.isfinite(out).all() and np.isfinite(g).all() and np.isfinite(beta).all()
    np.testing.assert_allclose(out[:, normed:], expected_out[:, normed:], rtol=ELEMENTWISE_BOUND, atol=1e-7)
    assert rel_err(out[:, :normed], expected_out[:, :normed]) < NORM_BOUND
    np.testing.assert_allclose(g, expected_g, rtol=ELEMENTWISE_BOUND, atol=0)
    np.testing.assert_allclose(beta, expected_beta, rtol=ELEMENTWISE_BOUND, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", INPUT_SHAPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_delta_net_inputs_match_numpy_over_prompts_of_1_to_150_tokens_in_one_launch(gpu, shape, layout):
    rng = np.random.default_rng(shape[2])
    p = layer_inputs(rng, sum(PREFILL_LENGTHS), shape, layout)
    conv, _ = carried_states(rng, p.qkv.shape[1], 1, 1, 1, fresh=(PREFILL_SLOTS[1],), slots=8)
    state = _dev(conv)
    got = gpu_inputs(p, shape, state, PREFILL_LENGTHS, PREFILL_SLOTS)
    expected = numpy_inputs(p, shape, conv, PREFILL_LENGTHS, PREFILL_SLOTS)
    assert_inputs_match(got, expected, 2 * shape[0] * shape[2])
    assert np.array_equal(_host(state), expected[3])  # the last inputs, copied: every slot's, touched or not


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(16, 32, 128, 128), INPUT_SHAPES[1]])  # Qwen3.5's: 8,192 channels
@pytest.mark.parametrize("layout", LAYOUTS)
def test_delta_net_inputs_match_numpy_in_a_decode_step_of_40_sequences(gpu, shape, layout):
    rng = np.random.default_rng(40 + shape[2])
    slots = rng.permutation(48)[:40]
    p = layer_inputs(rng, 40, shape, layout)
    conv, _ = carried_states(rng, p.qkv.shape[1], 1, 1, 1, fresh=(slots[3],), slots=48)
    state = _dev(conv)
    got = gpu_inputs(p, shape, state, [1] * 40, slots)
    expected = numpy_inputs(p, shape, conv, [1] * 40, slots)
    assert_inputs_match(got, expected, 2 * shape[0] * shape[2])
    assert np.array_equal(_host(state), expected[3])


@pytest.mark.gpu
@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_delta_net_inputs_are_the_same_bits_however_the_prompt_is_split(gpu, chunk):
    shape, total = INPUT_SHAPES[0], 150
    rng = np.random.default_rng(chunk)
    prompt = layer_inputs(rng, total, shape, "stacked")
    conv, _ = carried_states(rng, prompt.qkv.shape[1], 1, 1, 1)
    whole_state = _dev(conv)
    whole = gpu_inputs(prompt, shape, whole_state, [total], [1])

    state = _dev(conv)
    parts = []

    def launch(pieces, slots):
        (lo, hi), other = pieces
        o = layer_inputs(rng, other, shape, "stacked")
        step = SimpleNamespace(**{k: getattr(prompt, k) for k in ("conv_weight", "dt_bias", "a", "group", "layout")})
        step.qkv, step.alpha, step.beta = (np.concatenate([getattr(prompt, k)[lo:hi], getattr(o, k)])
                                           for k in ("qkv", "alpha", "beta"))  # fmt: skip
        parts.append([t[: hi - lo] for t in gpu_inputs(step, shape, state, [hi - lo, other], slots)])

    run_split(launch, total, chunk, other_slot=3, other_lengths=(2, 0, 9))
    for i, name in enumerate(("conv output", "g", "beta")):
        assert np.array_equal(np.concatenate([part[i] for part in parts]), whole[i]), name
    assert np.array_equal(_host(state)[1], _host(whole_state)[1])


# gated_delta_rule


def rule_inputs(rng, n: int, key_heads: int, v_heads: int, d_k: int, d_v: int):
    """The conv output's q | k | v [n, C] (q and k unit rows per key head, as the l2 norm leaves them), and g, beta
    [n, v_heads] in the ranges the gates give (decays exp(g) of 0.6-0.99)."""
    key = key_heads * d_k
    qk = rng.normal(0, 1, (n, 2, key_heads, d_k)).astype(np.float32)
    qk = cpu_delta_net.l2_norm(qk, 1e-6).reshape(n, 2 * key)
    v = rng.normal(0, 1, (n, v_heads * d_v)).astype(np.float32)
    wide = np.concatenate([qk, v], axis=1)
    g = -rng.uniform(0.01, 0.5, (n, v_heads)).astype(np.float32)
    beta = rng.uniform(0.05, 0.95, (n, v_heads)).astype(np.float32)
    return wide, g, beta


def numpy_rule(wide, g, beta, key_heads, d_k, delta, lengths, slots, pairing):
    """CpuOps.gated_delta_rule's output and the state it leaves (delta is copied)."""
    n, v_heads, d_v = len(wide), delta.shape[2], delta.shape[4]
    key = key_heads * d_k
    q, k = (wide[:, lo : lo + key].reshape(n, key_heads, d_k) for lo in (0, key))
    v = wide[:, 2 * key :].reshape(n, v_heads, d_v)
    batch, _, _ = sequences(lengths, slots)
    cache = SimpleNamespace(delta=delta.copy())
    out = CpuOps().gated_delta_rule(q, k, v, g, beta, pairing, 1 / np.sqrt(d_k), cache, LAYER, batch)
    return out, cache.delta


def gpu_rule(wide_d, g, beta, key_heads, d_k, state, lengths, slots, pairing, contiguous_qk=False):
    """The kernel's output for q, k, v read as column ranges of wide_d [n, C] (contiguous_qk: q and k copied out
    first); state (device) is updated in place."""
    from infero.backends.cuda import delta_net

    n = wide_d.shape[0]
    _, _, v_heads, _, d_v = state.shape
    key = key_heads * d_k
    q, k = (columns(wide_d, lo, lo + key) for lo in (0, key))
    if contiguous_qk:
        wide = _host(wide_d)
        q, k = (_dev(wide[:, lo : lo + key].reshape(n, key_heads, d_k)) for lo in (0, key))
    v = columns(wide_d, 2 * key, 2 * key + v_heads * d_v)
    _, starts, slots_d = sequences(lengths, slots)
    out = _poisoned((n, v_heads, d_v))
    delta_net.gated_delta_rule(out, q, k, v, _dev(g), _dev(beta), pairing, 1 / np.sqrt(d_k), state, starts,
                               slots_d, LAYER, _stream())  # fmt: skip
    return _host(out)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", RULE_SHAPES)
@pytest.mark.parametrize("pairing", ["tiled", "grouped"])
def test_delta_rule_matches_numpy_over_sequences_of_1_to_130_tokens_in_one_launch(gpu, shape, pairing):
    key_heads, v_heads, d_k, d_v = shape
    rng = np.random.default_rng(d_k + d_v)
    n = sum(LENGTHS)
    wide, g, beta = rule_inputs(rng, n, key_heads, v_heads, d_k, d_v)
    _, delta = carried_states(rng, 1, v_heads, d_k, d_v, fresh=(SLOTS[2],))
    state = _dev(delta)
    out = gpu_rule(_dev(wide), g, beta, key_heads, d_k, state, LENGTHS, SLOTS, pairing)
    expected, expected_state = numpy_rule(wide, g, beta, key_heads, d_k, delta, LENGTHS, SLOTS, pairing)
    assert np.isfinite(out).all()
    starts = np.concatenate([[0], np.cumsum(LENGTHS)])
    for s, slot in enumerate(SLOTS):
        lo, hi = starts[s], starts[s + 1]
        assert rel_err(out[lo:hi], expected[lo:hi]) < RULE_BOUND, f"sequence {s} ({hi - lo} tokens)"
        assert rel_err(_host(state)[slot, LAYER], expected_state[slot, LAYER]) < RULE_BOUND, f"slot {slot}"
    untouched = [i for i in range(NUM_SLOTS) if i not in SLOTS]
    after = _host(state)
    assert np.array_equal(after[untouched], delta[untouched]) and np.array_equal(after[:, 0], delta[:, 0])


@pytest.mark.gpu
def test_delta_rule_takes_contiguous_q_and_k_as_well(gpu):
    key_heads, v_heads, d_k, d_v = RULE_SHAPES[0]
    rng = np.random.default_rng(11)
    wide, g, beta = rule_inputs(rng, 40, key_heads, v_heads, d_k, d_v)
    _, delta = carried_states(rng, 1, v_heads, d_k, d_v)
    strided, contiguous = _dev(delta), _dev(delta)
    wide_d = _dev(wide)
    a = gpu_rule(wide_d, g, beta, key_heads, d_k, strided, [40], [3], "tiled")
    b = gpu_rule(wide_d, g, beta, key_heads, d_k, contiguous, [40], [3], "tiled", contiguous_qk=True)
    assert np.array_equal(a, b) and np.array_equal(_host(strided), _host(contiguous))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [RULE_SHAPES[0], RULE_SHAPES[2]])
@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_delta_rule_output_and_state_are_the_same_bits_however_the_prompt_is_split(gpu, shape, chunk):
    key_heads, v_heads, d_k, d_v = shape
    rng = np.random.default_rng(chunk)
    total = 130
    prompt, g, beta = rule_inputs(rng, total, key_heads, v_heads, d_k, d_v)
    _, delta = carried_states(rng, 1, v_heads, d_k, d_v)
    whole_state = _dev(delta)
    whole = gpu_rule(_dev(prompt), g, beta, key_heads, d_k, whole_state, [total], [1], "tiled")

    state = _dev(delta)
    outs = []

    def launch(pieces, slots):
        (lo, hi), other = pieces
        o_wide, o_g, o_beta = rule_inputs(rng, other, key_heads, v_heads, d_k, d_v)
        wide = np.concatenate([prompt[lo:hi], o_wide])
        step_g, step_beta = np.concatenate([g[lo:hi], o_g]), np.concatenate([beta[lo:hi], o_beta])
        out = gpu_rule(_dev(wide), step_g, step_beta, key_heads, d_k, state, [hi - lo, other], slots, "tiled")
        outs.append(out[: hi - lo])

    run_split(launch, total, chunk, other_slot=3, other_lengths=(2, 0, 9))
    assert np.array_equal(np.concatenate(outs), whole)
    assert np.array_equal(_host(state)[1], _host(whole_state)[1])


@pytest.mark.gpu
def test_a_sequence_without_a_valid_slot_gets_nan_and_touches_no_state(gpu):
    """A slot outside the state (the CPU op raises before it runs) must not corrupt another slot's memory."""
    key_heads, v_heads, d_k, d_v = RULE_SHAPES[2]
    rng = np.random.default_rng(5)
    wide, g, beta = rule_inputs(rng, 10, key_heads, v_heads, d_k, d_v)
    conv, delta = carried_states(rng, wide.shape[1], v_heads, d_k, d_v)
    state = _dev(delta)
    out = gpu_rule(_dev(wide), g, beta, key_heads, d_k, state, [4, 6], [2, NUM_SLOTS], "tiled")
    assert np.isfinite(out[:4]).all() and np.isnan(out[4:]).all()
    after = _host(state)
    assert np.array_equal(np.delete(after, 2, axis=0), np.delete(delta, 2, axis=0))

    conv_d = _dev(conv)
    inputs = layer_inputs(rng, 13, INPUT_SHAPES[2], "fused")
    out, g, beta_out = gpu_inputs(inputs, INPUT_SHAPES[2], conv_d, [4, 6, 3], [-1, 2, NUM_SLOTS])
    assert np.isnan(out[:4]).all() and np.isfinite(out[4:10]).all() and np.isnan(out[10:]).all()
    assert np.isfinite(g).all() and np.isfinite(beta_out).all()  # the gates need no state
    assert np.array_equal(np.delete(_host(conv_d), 2, axis=0), np.delete(conv, 2, axis=0))


# gated_rms_norm, sigmoid_gate


@pytest.mark.gpu
@pytest.mark.parametrize("d_v", [32, 128])
@pytest.mark.parametrize("in_place", [False, True])
def test_gated_rms_norm_matches_numpy(gpu, d_v, in_place):
    from infero.backends.cuda import delta_net

    rng = np.random.default_rng(d_v)
    n, heads = 70, 4
    x = rng.normal(0, 1, (n, heads, d_v)).astype(np.float32)
    z = rng.normal(0, 2, (n, 3 * heads * d_v)).astype(np.float32)  # the gate: the middle third of each row
    weight = (1 + 0.1 * rng.normal(0, 1, d_v)).astype(np.float32)
    x_d = _dev(x)
    out = x_d if in_place else _poisoned(x.shape)
    gate = columns(_dev(z), heads * d_v, 2 * heads * d_v)
    delta_net.gated_rms_norm(out, x_d, _dev(weight), gate, 1e-6, _stream())
    expected = CpuOps().gated_rms_norm(x, weight, z[:, heads * d_v : 2 * heads * d_v].reshape(n, heads, d_v), 1e-6)
    got = _host(out)
    assert np.isfinite(got).all()
    assert rel_err(got, expected) < NORM_BOUND


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["elementwise", "one column a row", "per-head gate columns", "added to a sum"])
def test_sigmoid_gate_matches_numpy(gpu, case):
    from infero.backends.cuda import delta_net

    rng = np.random.default_rng(3)
    n, heads, head_dim = 37, 4, 64
    x = rng.normal(0, 1, (n, heads, head_dim)).astype(np.float32)
    if case == "elementwise":
        gate = rng.normal(0, 3, x.shape).astype(np.float32)
        gate_d, expected_gate = _dev(gate), gate
    elif case in ("one column a row", "added to a sum"):  # the shared expert's [n, 1] over [n, hidden]
        x = x.reshape(n, heads * head_dim)
        gate = rng.normal(0, 3, (n, 1)).astype(np.float32)
        gate_d, expected_gate = _dev(gate), gate
    else:  # gated attention's q_gate [n, heads, 2 head_dim]: each head's second half
        q_gate = rng.normal(0, 3, (n, heads, 2 * head_dim)).astype(np.float32)
        gate_d, expected_gate = columns(_dev(q_gate), head_dim, 2 * head_dim), q_gate[..., head_dim:]
    expected = CpuOps().sigmoid_gate(x, expected_gate)
    if case == "added to a sum":  # qwen35moe's routed experts + the gated shared expert, written over the sum
        routed = rng.normal(0, 1, x.shape).astype(np.float32)
        out = _dev(routed)
        delta_net.sigmoid_gate(out, _dev(x), gate_d, _stream(), addend=out)
        expected = routed + expected
    else:
        out = _poisoned(x.shape)
        delta_net.sigmoid_gate(out, _dev(x), gate_d, _stream())
    atol = 1e-6 if case == "added to a sum" else 0  # a sum near 0 cancels: its error is the addends' rounding
    np.testing.assert_allclose(_host(out), expected, rtol=ELEMENTWISE_BOUND, atol=atol)


# reset_states


@pytest.mark.gpu
def test_reset_zeroes_every_layer_of_the_listed_slots_and_nothing_else(gpu):
    from infero.backends.cuda import delta_net

    rng = np.random.default_rng(1)
    conv, delta = carried_states(rng, 192, 4, 16, 32, fresh=())
    conv_d, delta_d = _dev(conv), _dev(delta)
    delta_net.reset_states(conv_d, delta_d, _dev(np.array([3, -1, 0], np.int32)), _stream())
    conv_after, delta_after = _host(conv_d), _host(delta_d)
    assert not conv_after[[0, 3]].any() and not delta_after[[0, 3]].any()
    kept = [1, 2, 4, 5]
    assert np.array_equal(conv_after[kept], conv[kept]) and np.array_equal(delta_after[kept], delta[kept])


# What runs without a GPU: the launchers' checks and launch geometry, and which models compile the kernels.


@pytest.fixture
def launches(monkeypatch):
    from infero.backends.cuda import delta_net

    return record_launches(monkeypatch, delta_net)


def rule_call(d_k=128, d_v=128, key_heads=2, v_heads=4, n=5, seqs=2, pairing="tiled", slots_dtype=np.int32,
              k_cols=None, layer=1):  # fmt: skip
    from infero.backends.cuda import delta_net

    key = key_heads * d_k
    wide = tensor((n, 2 * key + v_heads * d_v))
    q = columns(wide, 0, key)
    k = columns(wide, key, key + (k_cols or key))
    v = columns(wide, 2 * key, wide.shape[1])
    delta_net.gated_delta_rule(tensor((n, v_heads, d_v)), q, k, v, tensor((n, v_heads)), tensor((n, v_heads)),
                               pairing, 0.1, tensor((8, 2, v_heads, d_k, d_v)), tensor((seqs + 1,), np.int32),
                               tensor((seqs,), slots_dtype), layer, None)  # fmt: skip


def test_the_delta_rule_runs_a_block_per_sequence_and_32_columns_of_a_value_head_four_threads_a_column(launches):
    rule_call(d_k=128, d_v=128, v_heads=4, seqs=3)
    rule_call(d_k=16, d_v=32, v_heads=4, seqs=1)
    assert launches == [("gated_delta_rule<128>", (16, 3), (128,)), ("gated_delta_rule<16>", (4, 1), (128,))]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(d_k=48), r"compiled for d_k in \(16, 32, 64, 128\), got 48"),
        (dict(d_v=256), "d_v a multiple of 32 up to 128, got 256"),
        (dict(d_v=40), "d_v a multiple of 32"),
        (dict(key_heads=3, v_heads=4), "3 key heads must divide the 4 value heads"),
        (dict(k_cols=64), "must be the same whole heads of 128"),
        (dict(pairing="interleaved"), "pairing must be one of"),
        (dict(slots_dtype=np.int64), "state_slots must be int32"),
        (dict(layer=2), "layer 2 is not one of the state's 2 recurrent layers"),
    ],
)
def test_the_delta_rule_refuses_what_its_kernel_cannot_take(launches, kwargs, message):
    with pytest.raises(ValueError, match=message):
        rule_call(**kwargs)
    assert not launches


def inputs_call(n=40, channels=8192, heads=32, taps=4, d_k=128, normed=4096, starts=3, max_tokens=None,
                x_ptr=2 << 20, alpha_start=None, group=None, group_stride=0):  # fmt: skip
    """delta_net_inputs on stand-ins: Qwen3.5's 8,192 channels and 32 value heads by default, alpha and beta the
    columns of one [alpha | beta] projection; with alpha_start, Qwen3-Next's ba (beta from column 0)."""
    from infero.backends.cuda import delta_net

    ab = tensor((n, 2 * heads))
    alpha, beta = columns(ab, 0, heads), columns(ab, heads, 2 * heads)
    if alpha_start is not None:
        alpha, beta = columns(ab, alpha_start, 2 * heads), columns(ab, 0, 2 * heads)
    delta_net.delta_net_inputs(tensor((n, channels)), tensor((n, heads)), tensor((n, heads)),
                               tensor((n, channels), ptr=x_ptr), tensor((channels, taps)),
                               tensor((8, 2, channels, taps - 1)), alpha, beta, tensor((heads,)), tensor((heads,)), d_k,
                               normed, 1e-6, tensor((starts,), np.int32), tensor((2,), np.int32), 0, None, group,
                               group_stride, max_tokens)  # fmt: skip


def test_delta_net_inputs_runs_128_channels_of_a_sequence_and_16_tokens_a_block_and_one_more_for_the_gates(launches):
    inputs_call()
    inputs_call(max_tokens=33)
    inputs_call(max_tokens=1, alpha_start=16, group=16, group_stride=32)
    inputs_call(channels=192, d_k=16, normed=64, max_tokens=16)  # the tiny models': q | k and v share block 0
    grids = [(65, 2, 3), (65, 2, 3), (65, 2, 1), (3, 2, 1)]
    assert launches == [("delta_net_inputs<4>", grid, (128,)) for grid in grids]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(x_ptr=1 << 20), "out must not be x"),
        (dict(taps=3), r"compiled for kernels of \(4,\) taps, got 3"),
        (dict(starts=2), r"query_starts must be int32 \[3\]"),
        (dict(d_k=256), "d_k must divide 128"),
        (dict(d_k=48, normed=4032), "d_k must divide 128"),
        (dict(normed=4000), "must be whole heads of 128 within the 8192"),
        (dict(normed=8320), "must be whole heads of 128 within the 8192"),
        (dict(alpha_start=24, group=16, group_stride=32), "hold no head 31 at column 47"),  # 40 columns left
        (dict(group=5), "group 5 must divide the 32 value heads"),
    ],
)
def test_delta_net_inputs_refuses_what_its_kernel_cannot_take(launches, kwargs, message):
    with pytest.raises(ValueError, match=message):
        inputs_call(**kwargs)
    assert not launches


def test_the_sigmoid_gate_takes_a_gate_column_a_row_or_one_a_row_element_and_nothing_else(launches):
    from infero.backends.cuda import delta_net

    x = tensor((5, 4, 64))
    delta_net.sigmoid_gate(x, x, columns(tensor((5, 4, 128)), 64, 128), None)
    delta_net.sigmoid_gate(tensor((5, 256)), tensor((5, 256)), tensor((5, 1)), None)
    with pytest.raises(ValueError, match="must have x's 64 columns, or 1"):
        delta_net.sigmoid_gate(x, x, columns(tensor((5, 4, 128)), 64, 96), None)
    with pytest.raises(ValueError, match="must be float32"):
        delta_net.sigmoid_gate(x, x, tensor((5, 4, 64), np.float16), None)
    assert launches == [("sigmoid_gate", (5,), (256,)), ("sigmoid_gate", (5,), (256,))]


def test_columns_refuses_a_range_outside_the_row():

    with pytest.raises(ValueError, match=r"columns \[60, 70\) are not within a row of 64"):
        columns(tensor((3, 64)), 60, 70)


@pytest.mark.parametrize("name, hybrid", [("tiny-qwen35", True), ("tiny-qwen3next", True), ("tiny-qwen3", False)])
def test_only_a_hybrid_model_compiles_the_delta_net_kernels(name, hybrid):
    from infero.backends.cuda import delta_net, runtime
    from infero.checkpoint import load_checkpoint

    needs = runtime.checkpoint_needs(load_checkpoint(FIXTURES / f"{name}.gguf"))
    assert (runtime.DELTA_NET in needs) == hybrid
    names = {n for u, ns in runtime.needed_units(needs).items() if u.filename == delta_net.SOURCE for n in ns}
    expected = {"gated_delta_rule<16>", "delta_net_inputs<4>", "reset_states", "sigmoid_gate"} if hybrid else set()
    assert expected <= names and bool(names) == hybrid
