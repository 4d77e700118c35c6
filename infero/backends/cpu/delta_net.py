"""The Gated DeltaNet's sequence ops in numpy (Yang, Kautz and Hatamizadeh 2024, "Gated Delta Networks"), for one
sequence at a time: the causal conv1d that carries its last inputs, and the gated delta rule in its two forms.

The recurrent form is what the CPU engine runs: token by token, each token's products shaped by the head sizes
alone, so a prompt gives the same bits however the scheduler splits it. The chunked form (64 tokens a chunk, the
intra-chunk updates solved as one triangular system) computes the same function with matrix products, as the GPU
kernels will; it is their reference, tested against the recurrent form.

Shapes: T tokens, H value heads, d_k key and d_v value dimensions; q and k already hold the key head that serves
each value head. The state S [H, d_k, d_v] is float32 and updated in place.
"""

from __future__ import annotations

import numpy as np

DELTA_RULE_CHUNK = 64


def causal_conv1d(x: np.ndarray, weight: np.ndarray, state: np.ndarray) -> np.ndarray:
    """Depthwise causal convolution of x [T, C] with taps weight [C, K], then SiLU; state [C, K - 1] holds the
    K - 1 inputs before x (oldest first) and is replaced by the last K - 1 inputs. Tap j multiplies the input
    K - 1 - j steps back, as torch's Conv1d with K - 1 zeros of left padding does."""
    taps = weight.shape[1]
    inputs = np.concatenate([state.T, x])  # [K - 1 + T, C]
    rows = np.ascontiguousarray(weight.T)  # each tap's row contiguous: 3x faster than strided columns
    out = rows[0] * inputs[: len(x)]
    for j in range(1, taps):
        out += rows[j] * inputs[j : j + len(x)]
    state[...] = inputs[len(inputs) - (taps - 1) :].T
    return out / (1.0 + np.exp(-out))


def delta_rule_recurrent(q, k, v, g, beta, state: np.ndarray) -> np.ndarray:
    """o [T, H, d_v] of the gated delta rule, one token at a time:
    S <- S exp(g); delta = beta (v - S^T k); S <- S + k delta^T; o = S^T q."""
    out = np.empty(v.shape, np.float32)
    decay = np.exp(g)
    for t in range(len(q)):
        state *= decay[t, :, None, None]
        predicted = (k[t, :, None, :] @ state)[:, 0]  # S^T k: [H, d_v]
        delta = (v[t] - predicted) * beta[t, :, None]
        state += k[t, :, :, None] * delta[:, None, :]
        out[t] = (q[t, :, None, :] @ state)[:, 0]
    return out


def delta_rule_chunked(q, k, v, g, beta, state: np.ndarray, start_position: int = 0,
                       chunk: int = DELTA_RULE_CHUNK) -> np.ndarray:  # fmt: skip
    """delta_rule_recurrent's output and final state, in chunks that end at multiples of `chunk` positions from
    the sequence start (the tokens start at start_position): however a prompt is split at those multiples, its
    chunks are the same, and so are their bits.

    Within a chunk, with G_t the cumulative log decay from its start and D[i, j] = exp(G_i - G_j) for j <= i, the
    chunk's corrections u (the delta rule's new values) satisfy (I + L) u = beta (v - exp(G) k S), L[i, j] =
    beta_i k_i.k_j D[i, j] for j < i: one unit lower-triangular solve instead of T sequential updates. Then
    o = exp(G) q S + (q k^T * D) u and S <- exp(G_last) S + (exp(G_last - G) k)^T u.
    """
    out = np.empty(v.shape, np.float32)
    bounds = [0, *range(chunk - start_position % chunk, len(q), chunk), len(q)]
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        if lo == hi:  # no tokens
            continue
        c = slice(lo, hi)
        qc, kc, vc = (a[c].transpose(1, 0, 2) for a in (q, k, v))  # [H, n, d]
        bc = beta[c].T[:, :, None]  # [H, n, 1]
        cum = np.cumsum(g[c].T, axis=1)  # [H, n]
        n = cum.shape[1]
        causal = np.tril(np.ones((n, n), bool))
        decay = np.where(causal, np.exp(np.where(causal, cum[:, :, None] - cum[:, None, :], 0.0)), 0.0)
        kk = kc @ kc.transpose(0, 2, 1)  # [H, n, n]
        system = np.eye(n, dtype=np.float32) + np.tril(bc * kk * decay, -1)
        rhs = bc * (vc - (np.exp(cum)[:, :, None] * kc) @ state)
        corrections = np.linalg.solve(system, rhs).astype(np.float32)  # [H, n, d_v]
        inter = (np.exp(cum)[:, :, None] * qc) @ state
        intra = ((qc @ kc.transpose(0, 2, 1)) * decay) @ corrections
        out[c] = (inter + intra).transpose(1, 0, 2)
        last = cum[:, -1:]
        state *= np.exp(last)[:, :, None]
        state += (np.exp(last - cum)[:, :, None] * kc).transpose(0, 2, 1) @ corrections
    return out


def l2_norm(x: np.ndarray, eps: float) -> np.ndarray:
    """x / sqrt(sum(x^2) + eps) over the last axis (as transformers' and FLA's l2norm)."""
    return x / np.sqrt(np.sum(np.square(x), axis=-1, keepdims=True) + eps)
