"""The CPU backend's mixture-of-experts ops: Qwen3-MoE routing and the weighted sum of SwiGLU experts."""

import math

import numpy as np
import pytest

from infero.backends.cpu.ops import CpuOps

OPS = CpuOps()


def route(logits: list[float], k: int):
    """moe_route of one token whose router logits are exactly `logits` (a one-hot input reads one router column)."""
    router = np.zeros((len(logits), 4), np.float32)
    router[:, 0] = logits
    x = np.array([[1.0, 0.0, 0.0, 0.0]], np.float32)
    experts, weights = OPS.moe_route(x, router, k)
    return experts[0].tolist(), weights[0]


def softmax_of(logits: list[float]) -> list[float]:
    total = sum(math.exp(v) for v in logits)
    return [math.exp(v) / total for v in logits]


def test_route_picks_the_k_most_probable_and_renormalizes_their_weights():
    logits = [0.5, 2.0, -1.0, 1.5, 0.0]
    experts, weights = route(logits, 2)
    assert experts == [1, 3]
    p = softmax_of(logits)
    np.testing.assert_allclose(weights, [p[1] / (p[1] + p[3]), p[3] / (p[1] + p[3])], rtol=1e-6)


def test_route_ties_rank_the_lower_expert_id_first():
    assert route([1.0, 3.0, 3.0, 2.0], 1)[0] == [1]
    assert route([1.0, 3.0, 3.0, 2.0], 2)[0] == [1, 2]
    assert route([2.0, 0.0, 2.0, 2.0], 2)[0] == [0, 2]
    experts, weights = route([0.0, 0.0, 0.0, 0.0], 3)
    assert experts == [0, 1, 2]
    np.testing.assert_allclose(weights, [1 / 3] * 3, rtol=1e-6)


def test_route_with_k_one_gives_the_expert_weight_one():
    experts, weights = route([0.1, -0.3, 0.7, 0.2], 1)
    assert experts == [2] and weights.tolist() == [1.0]


def test_route_with_k_all_experts_keeps_the_softmax_weights():
    logits = [0.1, -0.3, 0.7, 0.2]
    experts, weights = route(logits, 4)
    assert experts == [2, 3, 0, 1]
    p = softmax_of(logits)
    np.testing.assert_allclose(weights, [p[2], p[3], p[0], p[1]], rtol=1e-6)


def random_experts(num_experts: int, hidden: int = 16, width: int = 8, seed: int = 0):
    rng = np.random.default_rng(seed)
    gate = rng.normal(0, 0.3, (num_experts, width, hidden)).astype(np.float32)
    up = rng.normal(0, 0.3, (num_experts, width, hidden)).astype(np.float32)
    down = rng.normal(0, 0.3, (num_experts, hidden, width)).astype(np.float32)
    return gate, up, down


def expert_mixture(x, experts, weights, gate, up, down) -> np.ndarray:
    """The mixture in float64, token by token, straight from its definition."""
    out = np.zeros((len(x), down.shape[1]))
    for t in range(len(x)):
        xt = x[t].astype(np.float64)
        for e, w in zip(experts[t], weights[t], strict=True):
            g, u = gate[e] @ xt, up[e] @ xt
            out[t] += w * (down[e] @ (g / (1 + np.exp(-g)) * u))
    return out


@pytest.mark.parametrize(
    "experts",
    [
        [[0, 3], [3, 1], [2, 3], [3, 0]],  # expert 3 chosen by every token, 4 to 7 by none
        [[5], [5], [1], [7]],  # k = 1
        [[7, 6, 5, 4, 3, 2, 1, 0], [0, 1, 2, 3, 4, 5, 6, 7], [3, 1, 4, 0, 5, 2, 7, 6], [1, 0, 2, 3, 4, 5, 6, 7]],
    ],
    ids=["shared-and-unused-experts", "k1", "k-all"],
)
def test_experts_sum_each_tokens_chosen_experts_by_weight(experts):
    rng = np.random.default_rng(1)
    x = rng.normal(0, 1, (4, 16)).astype(np.float32)
    experts = np.array(experts)
    weights = rng.uniform(0.1, 1, experts.shape).astype(np.float32)
    weights /= weights.sum(-1, keepdims=True)
    gate, up, down = random_experts(8)
    got = OPS.moe_experts(x, experts, weights, gate, up, down)
    want = expert_mixture(x, experts, weights, gate, up, down)
    assert np.abs(got - want).max() < 1e-5 * np.abs(want).max()


def test_a_tokens_expert_output_does_not_depend_on_who_else_chose_its_experts():
    rng = np.random.default_rng(2)
    x = rng.normal(0, 1, (6, 16)).astype(np.float32)
    experts = np.array([[2, 5], [2, 5], [5, 2], [0, 1], [2, 7], [5, 6]])
    weights = rng.uniform(0.1, 1, experts.shape).astype(np.float32)
    gate, up, down = random_experts(8, seed=3)
    together = OPS.moe_experts(x, experts, weights, gate, up, down)
    for t in range(len(x)):
        alone = OPS.moe_experts(x[t : t + 1], experts[t : t + 1], weights[t : t + 1], gate, up, down)
        assert np.array_equal(alone[0], together[t])


def test_a_shared_expert_folded_in_as_one_more_expert_is_routed_plus_its_sigmoid_gated_output():
    """Qwen3.5-MoE's shared expert as expert 8 of the stacked experts and its gate as the router's last row: the
    (k + 1)-th pair of every token, weighted sigmoid(gate), gives routed + sigmoid(gate) shared, as apart."""
    rng = np.random.default_rng(4)
    x = rng.normal(0, 1, (5, 16)).astype(np.float32)
    router, shared_gate = rng.normal(0, 1, (8, 16)).astype(np.float32), rng.normal(0, 1, (1, 16)).astype(np.float32)
    gate, up, down = random_experts(9, seed=5)  # expert 8: the shared one
    experts, weights = OPS.moe_route(x, np.concatenate([router, shared_gate]), 2, shared=True)
    folded = OPS.moe_experts(x, experts, weights, gate, up, down)
    routed_ids, routed_weights = OPS.moe_route(x, router, 2)
    assert np.array_equal(experts[:, :2], routed_ids) and (experts[:, 2] == 8).all()
    assert np.array_equal(weights[:, :2], routed_weights)
    routed = OPS.moe_experts(x, routed_ids, routed_weights, gate[:8], up[:8], down[:8])
    shared = OPS.swiglu(x @ gate[8].T, x @ up[8].T) @ down[8].T
    apart = OPS.sigmoid_gate(shared, OPS.linear(x, shared_gate), addend=routed)
    assert np.abs(folded - apart).max() < 1e-5 * np.abs(apart).max()
