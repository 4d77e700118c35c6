"""The Gated DeltaNet's numpy ops: the delta rule's recurrent form against the rule written out in float64, its
chunked form against the recurrent one, and the conv1d's carried state."""

import numpy as np
import pytest

from infero.backends.cpu.delta_net import causal_conv1d, delta_rule_chunked, delta_rule_recurrent, l2_norm

HEADS, D_K, D_V = 4, 16, 32


def inputs(length: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((length, HEADS, D_K)).astype(np.float32)
    k = rng.standard_normal((length, HEADS, D_K)).astype(np.float32)
    q = q / np.linalg.norm(q, axis=-1, keepdims=True) / np.sqrt(D_K)
    k = k / np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((length, HEADS, D_V)).astype(np.float32)
    g = -rng.uniform(0.0, 0.7, (length, HEADS)).astype(np.float32)
    beta = rng.uniform(0.0, 1.0, (length, HEADS)).astype(np.float32)
    state = rng.standard_normal((HEADS, D_K, D_V)).astype(np.float32)
    return q, k, v, g, beta, state


def delta_rule_float64(q, k, v, g, beta, state):
    """The gated delta rule as the paper states it, per head and token, in float64."""
    s = state.astype(np.float64).copy()
    out = np.zeros(v.shape)
    for t in range(len(q)):
        for h in range(HEADS):
            s[h] = s[h] * np.exp(float(g[t, h]))
            delta = beta[t, h] * (v[t, h] - s[h].T @ k[t, h])
            s[h] = s[h] + np.outer(k[t, h], delta)
            out[t, h] = s[h].T @ q[t, h]
    return out, s


def test_the_recurrent_delta_rule_matches_the_rule_written_out_in_float64():
    q, k, v, g, beta, state = inputs(20)
    want, want_state = delta_rule_float64(q, k, v, g, beta, state)
    out = delta_rule_recurrent(q, k, v, g, beta, state)
    assert np.abs(out - want).max() < 1e-5 * np.abs(want).max()
    assert np.abs(state - want_state).max() < 1e-5 * np.abs(want_state).max()


@pytest.mark.parametrize("length", [1, 63, 64, 65, 130])
def test_the_chunked_delta_rule_equals_the_recurrent_one(length):
    q, k, v, g, beta, state = inputs(length, seed=length)
    chunked_state = state.copy()
    want = delta_rule_recurrent(q, k, v, g, beta, state)
    out = delta_rule_chunked(q, k, v, g, beta, chunked_state)
    assert np.abs(out - want).max() < 1e-5 * np.abs(want).max()
    assert np.abs(chunked_state - state).max() < 1e-5 * np.abs(state).max()


def run_chunked(args, state, splits):
    """delta_rule_chunked over the parts of a sequence cut at `splits`, its state carried."""
    bounds = [0, *splits, len(args[0])]
    return np.concatenate([delta_rule_chunked(*(a[lo:hi] for a in args), state, start_position=lo)
                           for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)])  # fmt: skip


def test_the_chunked_delta_rule_carries_its_state_from_one_call_to_the_next():
    *args, state = inputs(130, seed=7)
    whole = run_chunked(args, state.copy(), [])
    split = run_chunked(args, state.copy(), [70])
    assert np.abs(split - whole).max() < 1e-5 * np.abs(whole).max()


def test_a_prompt_split_at_multiples_of_64_gives_the_chunked_bits_of_the_whole():
    *args, state = inputs(150, seed=8)
    assert np.array_equal(run_chunked(args, state.copy(), [64, 128]), run_chunked(args, state.copy(), []))


def test_a_call_that_starts_mid_chunk_ends_its_first_chunk_at_the_next_multiple_of_64():
    *args, state = inputs(150, seed=9)
    aligned = run_chunked(args, state.copy(), [70, 128])  # chunks 0-64, 64-70 | 70-128 | 128-150
    assert np.array_equal(run_chunked(args, state.copy(), [70]), aligned)
    # The control: the same second part chunked from its own first token (70-134 | 134-150) differs in its bits.
    carried = state.copy()
    first = delta_rule_chunked(*(a[:70] for a in args), carried)
    unaligned = delta_rule_chunked(*(a[70:] for a in args), carried, start_position=0)
    assert not np.array_equal(np.concatenate([first, unaligned]), aligned)


def test_the_recurrent_delta_rule_gives_the_same_bits_however_a_sequence_is_split():
    q, k, v, g, beta, state = inputs(40, seed=3)
    whole_state, split_state = state.copy(), state.copy()
    whole = delta_rule_recurrent(q, k, v, g, beta, whole_state)
    parts = [delta_rule_recurrent(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], split_state)
             for a, b in ((0, 1), (1, 8), (8, 40))]  # fmt: skip
    assert np.array_equal(np.concatenate(parts), whole) and np.array_equal(split_state, whole_state)


def test_the_conv1d_state_makes_a_split_sequence_equal_the_whole_bitwise():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((30, 12)).astype(np.float32)
    weight = rng.standard_normal((12, 4)).astype(np.float32)
    whole = causal_conv1d(x, weight, np.zeros((12, 3), np.float32))
    state = np.zeros((12, 3), np.float32)
    parts = [causal_conv1d(x[a:b], weight, state) for a, b in ((0, 1), (1, 3), (3, 30))]
    assert np.array_equal(np.concatenate(parts), whole)
    assert np.array_equal(state, x[-3:].T)


def test_the_conv1d_is_causal_with_the_last_tap_on_the_current_input():
    x = np.zeros((6, 1), np.float32)
    x[2] = 1.0  # an impulse at t = 2
    weight = np.array([[1.0, 2.0, 3.0, 4.0]], np.float32)
    pre_silu = np.array([0, 0, 4, 3, 2, 1], np.float32)
    out = causal_conv1d(x, weight, np.zeros((1, 3), np.float32))[:, 0]
    assert np.allclose(out, pre_silu / (1 + np.exp(-pre_silu)))


def test_l2_norm_gives_unit_vectors():
    x = np.random.default_rng(2).standard_normal((5, 3, 16)).astype(np.float32)
    assert np.allclose(np.linalg.norm(l2_norm(x, 1e-6), axis=-1), 1.0, atol=1e-6)
