"""kernels/delta_rule_chunked.cu's algorithm in numpy, against the gated delta rule in float64: its WY form (what
delta_rule_prepare computes for every chunk at once: W, A, Q', O', Kt; then delta_rule_chunked's walk: u = A - W S,
o = Q' S + O', S <- exp(G_last) S + Kt^T u), every product in the kernels' 3xTF32 split (each operand x = big +
small, big = tf32(x), small = tf32(x - big); a b ~ small big + big small + big big), the cumulative decay by its
scan over the lanes, T = (I + L)^-1 applied by 16-row blocks (each diagonal block inverted by forward substitution,
then X_r = T_r (rhs_r - sum L_rs X_s)). It differs from backends/cpu/delta_net.py's delta_rule_chunked in those,
which is what these tests check in float32. Also the host's count of whole chunks (delta_rule_chunked.whole_chunks)
against a count by hand.
"""

from __future__ import annotations

import numpy as np
import pytest

from infero.backends.cpu.delta_net import delta_rule_recurrent, l2_norm
from infero.backends.cuda.delta_rule_chunked import CHUNK, whole_chunks

# |chunked - float64| / max |o| over a 512-token prompt the kernel must stay within (fp32-level accuracy).
BOUND = 2e-5


def tf32(x: np.ndarray) -> np.ndarray:
    """The kernel's tf32(x) (cvt.rna.tf32.f32 for finite x): the nearest float with 10 mantissa bits, ties away from
    zero."""
    bits = np.ascontiguousarray(x, np.float32).view(np.uint32)
    return ((bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32)


def mm3(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a @ b on the tensor cores in 3xTF32, fp32 sums."""
    a_big, b_big = tf32(a), tf32(b)
    a_small, b_small = tf32(a - a_big), tf32(b - b_big)
    return a_small @ b_big + a_big @ b_small + a_big @ b_big


def lane_scan(g: np.ndarray) -> np.ndarray:
    """The inclusive sum of 64 values as the kernel's warp scans it: tokens lane and 32 + lane by xor-free
    shuffle-up steps of 1, 2, 4, 8, 16, then the second half plus the first half's total."""
    x = g.reshape(2, 32).astype(np.float32).copy()
    step = 1
    while step < 32:
        shifted = np.zeros_like(x)
        shifted[:, step:] = x[:, :-step]
        x[:, step:] = x[:, step:] + shifted[:, step:]
        step *= 2
    x[1] = x[1] + x[0, 31]
    return x.reshape(64)


def inverse_unit_lower(block: np.ndarray) -> np.ndarray:
    """(I + L)^-1 of a 16 x 16 block whose strictly lower part is L, a column at a time by forward substitution in
    float32 (the kernel's thread a column)."""
    n = len(block)
    t = np.zeros((n, n), np.float32)
    for j in range(n):
        x = np.zeros(n, np.float32)
        x[j] = 1.0
        for i in range(j + 1, n):
            x[i] = -np.float32(np.dot(block[i, j:i].astype(np.float64), x[j:i]))
        t[:, j] = x
    return t


def prepare_chunk(q, k, v, g, beta) -> tuple[np.ndarray, ...]:
    """One head's 64-token chunk as delta_rule_prepare computes it, q already scaled: -W, A, Q', O', Kt and
    exp(G_last) (its record)."""
    cum = lane_scan(g)
    eg, eg_rest = np.exp(cum), np.exp(cum[-1] - cum)
    i, j = np.arange(CHUNK)[:, None], np.arange(CHUNK)[None, :]
    decay = np.exp(np.where(j <= i, cum[:, None] - cum[None, :], 0.0)).astype(np.float32)
    system = np.where(j < i, beta[:, None] * (mm3(k, k.T) * decay), 0.0).astype(np.float32)
    scores = np.where(j <= i, mm3(q, k.T) * decay, 0.0).astype(np.float32)
    rhs = np.concatenate([(beta * eg)[:, None] * k, beta[:, None] * v], axis=1)  # [W | A]'s right-hand sides
    x = np.zeros_like(rhs)
    for r in range(0, CHUNK, 16):
        w = rhs[r : r + 16] + mm3(-system[r : r + 16, :r], x[:r]) if r else rhs[r : r + 16]
        x[r : r + 16] = mm3(inverse_unit_lower(system[r : r + 16, r : r + 16]), w)
    w, a = x[:, : k.shape[1]], x[:, k.shape[1] :]
    q_prime = eg[:, None] * q + mm3(-scores, w)
    return -w, a, q_prime, mm3(scores, a), eg_rest[:, None] * k, eg[-1]


def walk_chunk(record, s: np.ndarray) -> np.ndarray:
    """delta_rule_chunked's products for one chunk: o [64, d_v] from its record and the state s [d_k, d_v] before
    it, s updated in place."""
    minus_w, a, q_prime, o_prime, kt, eg_last = record
    u = a + mm3(minus_w, s)
    out = o_prime + mm3(q_prime, s)
    s[...] = eg_last * s + mm3(kt.T, u)
    return out


def kernel_op(q, k, v, g, beta, state: np.ndarray, start: int) -> np.ndarray:
    """The op on one sequence's step of tokens at positions start ..: the recurrent form before its first whole
    chunk and after its last, the kernel's chunks between. Shapes as delta_rule_recurrent's."""
    n = len(q)
    head = -(-start // CHUNK) * CHUNK - start
    tail = (start + n) // CHUNK * CHUNK - start
    if tail <= head:
        head = tail = n
    out = np.empty(v.shape, np.float32)
    out[:head] = delta_rule_recurrent(q[:head], k[:head], v[:head], g[:head], beta[:head], state)
    for t0 in range(head, tail, CHUNK):
        c = slice(t0, t0 + CHUNK)
        for h in range(q.shape[1]):
            out[c, h] = walk_chunk(prepare_chunk(q[c, h], k[c, h], v[c, h], g[c, h], beta[c, h]), state[h])
    out[tail:] = delta_rule_recurrent(q[tail:], k[tail:], v[tail:], g[tail:], beta[tail:], state)
    return out


def float64_rule(q, k, v, g, beta, state):
    """The gated delta rule token by token in float64: o and the final state."""
    s = state.astype(np.float64)
    out = np.empty(v.shape)
    for t in range(len(q)):
        s *= np.exp(g[t].astype(np.float64))[:, None, None]
        delta = (v[t] - np.einsum("hkv,hk->hv", s, k[t])) * beta[t][:, None]
        s += k[t][:, :, None] * delta[:, None, :]
        out[t] = np.einsum("hkv,hk->hv", s, q[t])
    return out, s


def model_inputs(n: int, heads: int, d_k: int, d_v: int, seed: int):
    """q, k l2-normed (q times 1 / sqrt(d_k)), v ~ N(0, 1), gates as the model's: g in [-2, 0), beta in (0, 1);
    a carried state."""
    rng = np.random.default_rng(seed)
    q = l2_norm(rng.normal(0, 1, (n, heads, d_k)).astype(np.float32), 1e-6) * np.float32(1 / np.sqrt(d_k))
    k = l2_norm(rng.normal(0, 1, (n, heads, d_k)).astype(np.float32), 1e-6)
    v = rng.normal(0, 1, (n, heads, d_v)).astype(np.float32)
    g = -rng.uniform(0, 2, (n, heads)).astype(np.float32)
    beta = rng.uniform(0, 1, (n, heads)).astype(np.float32)
    state = rng.normal(0, 0.3, (heads, d_k, d_v)).astype(np.float32)
    return q.astype(np.float32), k.astype(np.float32), v, g, beta, state


@pytest.mark.parametrize("d_k, start, n, slow_decay", [(128, 0, 512, False), (128, 0, 512, True),
                                                       (64, 40, 200, False)])  # fmt: skip
def test_the_kernels_chunks_match_the_rule_in_float64(d_k, start, n, slow_decay):
    q, k, v, g, beta, state = model_inputs(n, 2, d_k, 32, seed=d_k + n)
    if slow_decay:  # decays near 1: the state keeps every token, the chunk's products carry the whole error
        g = g * np.float32(0.005)
    want, want_state = float64_rule(q, k, v, g, beta, state)
    out = kernel_op(q, k, v, g, beta, state, start)
    assert np.abs(out - want).max() < BOUND * np.abs(want).max()
    assert np.abs(state - want_state).max() < BOUND * np.abs(want_state).max()


def test_tf32_keeps_ten_mantissa_bits_rounding_ties_away_from_zero():
    x = np.array([1 + 2**-10, 1 + 2**-11, 1 + 3 * 2**-11, -(1 + 2**-11), 1 + 2**-11 - 2**-23], np.float32)
    assert tf32(x).tolist() == [1 + 2**-10, 1 + 2**-10, 1 + 2 * 2**-10, -(1 + 2**-10), 1.0]


def test_whole_chunks_counts_each_sequences_64_position_spans_inside_its_step():
    # (first position, tokens): 0-511 holds 8; 40-239 holds 64-127 and 128-191; 60-63 none; 64-127 one; 63-127
    # one; an empty sequence none; 100 tokens from 0 one.
    cases = [(0, 512), (40, 200), (60, 4), (64, 64), (63, 65), (7, 0), (0, 100)]
    lengths = [n for _, n in cases]
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    positions = np.concatenate([np.arange(p, p + n) for p, n in cases]).astype(np.int32)
    assert whole_chunks(positions, starts) == 8 + 2 + 0 + 1 + 1 + 0 + 1
    assert whole_chunks(np.arange(1, dtype=np.int32), np.array([0, 1], np.int32)) == 0  # a decode step


def test_every_whole_chunk_of_a_step_has_its_own_record_below_n_over_64():
    # The kernels keep sequence s's chunk c in record starts[s] // 64 + c; the launcher allocates n // 64 of them.
    rng = np.random.default_rng(0)
    for _ in range(500):
        lengths = rng.integers(0, 300, rng.integers(1, 9))
        firsts = rng.integers(0, 200, len(lengths))
        starts = np.concatenate([[0], np.cumsum(lengths)])
        records = []
        for s, (first, n) in enumerate(zip(firsts, lengths, strict=True)):
            chunks = max(0, (first + n) // CHUNK - -(-first // CHUNK))
            records += [starts[s] // CHUNK + c for c in range(chunks)]
        assert len(set(records)) == len(records)
        assert all(r < starts[-1] // CHUNK for r in records)
