"""The reference sampler against independent plain-Python versions of its documented rules."""

import math
import random
import warnings

import numpy as np
import pytest

from infero.engine.sampling import (
    Sampler,
    SampleResult,
    SamplingParams,
    apply_allowed_mask,
    apply_min_p,
    apply_penalties,
    apply_top_k,
    apply_top_p,
)
from infero.errors import InferoError

M64 = (1 << 64) - 1


# ---- independent references ----


def philox4x64_10(counter, key):
    """Random123's Philox4x64-10, written from the paper's constants."""
    c, k = list(counter), list(key)
    for rnd in range(10):
        if rnd:
            k = [(k[0] + 0x9E3779B97F4A7C15) & M64, (k[1] + 0xBB67AE8584CAA73B) & M64]
        p0, p1 = 0xD2E7470EE14C6C93 * c[0], 0xCA5A826395121157 * c[2]
        c = [(p1 >> 64) ^ c[1] ^ k[0], p1 & M64, (p0 >> 64) ^ c[3] ^ k[1], p0 & M64]
    return c


def documented_uniforms(key, index, stream, vocab_size):
    blocks = [philox4x64_10([b, index, stream, 0], [key % (1 << 64), 0]) for b in range(-(-vocab_size // 4))]
    return [((blocks[t // 4][t % 4] >> 12) + 0.5) / 2**52 for t in range(vocab_size)]


def log_softmax(values):
    top = max(values)
    log_total = math.log(sum(math.exp(v - top) for v in values))
    return [v - top - log_total for v in values]


def penalized(logits, params, prompt, output, banned=()):
    """Steps 2-5 of the module docstring, one token at a time."""
    out = []
    for t, x in enumerate(float(v) for v in logits):
        x += (params.logit_bias or {}).get(t, 0.0)
        if t in banned:
            x = -math.inf
        if t in prompt or t in output:
            x = x / params.repetition_penalty if x > 0 else x * params.repetition_penalty
        count = output.count(t)
        x -= params.frequency_penalty * count
        if count > 0:
            x -= params.presence_penalty
        out.append(x)
    return out


def support(z, params):
    """Steps 7-10: the token ids left after temperature, min_p, top_k and top_p, by the docstring's words."""
    z = [v / params.temperature for v in z]
    alive = {t for t, v in enumerate(z) if v > -math.inf}
    if params.min_p > 0:
        top = max(z[t] for t in alive)
        alive = {t for t in alive if math.exp(z[t] - top) >= params.min_p}
    if 0 < params.top_k < len(z):
        kth = sorted((z[t] for t in alive), reverse=True)[params.top_k - 1] if len(alive) >= params.top_k else -math.inf
        alive = {t for t in alive if z[t] >= kth}
    if params.top_p < 1.0:
        ranked = sorted(alive, key=lambda t: (-z[t], t))
        top = z[ranked[0]]
        total = sum(math.exp(z[t] - top) for t in ranked)
        kept, mass = set(), 0.0
        for t in ranked:
            if mass >= params.top_p:
                break
            kept.add(t)
            mass += math.exp(z[t] - top) / total
        alive = kept
    return alive, z


def chi2_sf(x, dof):
    """P(chi-square with `dof` degrees of freedom > x), from the series of the regularised lower gamma."""
    a, h = dof / 2, x / 2
    term = total = 1.0 / a
    n = 0
    while term > 1e-17 * total:
        n += 1
        term *= h / (a + n)
        total += term
    return 1.0 - math.exp(a * math.log(h) - h - math.lgamma(a)) * total


def draw(sampler, row, params, num, prompt=(), banned=None):
    """`num` independent draws of one row: as many rows in one batch (seeded rows get seeds 0..num-1)."""
    logits = np.tile(np.asarray(row, dtype=np.float32), (num, 1))
    if params.seed is not None:
        plist = [SamplingParams(**{**params.__dict__, "seed": s}) for s in range(num)]
    else:
        plist = [params] * num
    bans = None if banned is None else [banned] * num
    results = sampler.sample(logits, plist, [list(prompt)] * num, [[]] * num, bans)
    return np.array([r.token_id for r in results])


def random_logits(rng, vocab_size, num_seqs=1):
    return rng.normal(0.0, 2.0, size=(num_seqs, vocab_size)).astype(np.float32)


# ---- greedy ----


def test_greedy_takes_the_argmax_whatever_the_filters():
    rng = np.random.default_rng(0)
    logits = random_logits(rng, 100, num_seqs=16)
    params = [SamplingParams(temperature=0.0, top_k=3, top_p=0.2, min_p=0.5)] * 16
    results = Sampler(seed=0).sample(logits, params, [[]] * 16, [[]] * 16)
    assert [r.token_id for r in results] == list(np.argmax(logits, axis=1))
    assert all(r.logprob is None and r.top_logprobs is None for r in results)
    assert SamplingParams(temperature=0.0).greedy and not SamplingParams(temperature=0.01).greedy


def test_greedy_breaks_ties_towards_the_lower_id():
    logits = np.array([[0.0, 3.0, 1.0, 3.0]], dtype=np.float32)
    result = Sampler(seed=0).sample(logits, [SamplingParams(temperature=0)], [[]], [[]])
    assert result[0].token_id == 1


def test_greedy_rows_draw_no_noise_from_the_engine_stream():
    row = np.array([0.3, 0.1, 0.2, 0.0], dtype=np.float32)
    alone, mixed = Sampler(seed=5), Sampler(seed=5)
    sampled = [SamplingParams()] * 30
    expected = [r.token_id for r in alone.sample(np.tile(row, (30, 1)), sampled, [[]] * 30, [[]] * 30)]
    params = [p for pair in zip([SamplingParams(temperature=0)] * 30, sampled, strict=True) for p in pair]
    got = mixed.sample(np.tile(row, (60, 1)), params, [[]] * 60, [[]] * 60)
    assert [r.token_id for r in got[1::2]] == expected


# ---- seeded reproducibility and the noise ----


def test_same_seed_gives_same_tokens_across_samplers():
    rng = np.random.default_rng(1)
    logits = random_logits(rng, 50)
    params = [SamplingParams(seed=1234, top_p=0.9)]
    a, b = Sampler(seed=1), Sampler(seed=2)
    for i in range(40):
        history = list(range(i))
        assert a.sample(logits, params, [[]], [history]) == b.sample(logits, params, [[]], [history])


def test_different_seeds_give_different_token_sequences():
    logits = np.zeros((1, 64), dtype=np.float32)
    sampler = Sampler(seed=0)

    def sequence(seed):
        return [sampler.sample(logits, [SamplingParams(seed=seed)], [[]], [[0] * i])[0].token_id for i in range(30)]

    sequences = {tuple(sequence(seed)) for seed in range(6)}
    assert len(sequences) == 6
    assert sequence(3) == sequence(3)


def test_seeded_row_ignores_its_batch_neighbours_and_their_order():
    rng = np.random.default_rng(2)
    vocab = 40
    target = SamplingParams(seed=99, temperature=1.3)
    for step in range(20):
        logits = random_logits(rng, vocab, num_seqs=6)
        alone = Sampler(seed=0).sample(logits[:1], [target], [[]], [[7] * step])[0]
        others = [SamplingParams(seed=s) if s % 2 else SamplingParams() for s in range(5)]
        rows = [(logits[0], target, [7] * step)] + [(logits[j + 1], others[j], [1] * j) for j in range(5)]
        random.Random(step).shuffle(rows)
        batch = Sampler(seed=step).sample(
            np.stack([r[0] for r in rows]), [r[1] for r in rows], [[]] * 6, [r[2] for r in rows]
        )
        assert batch[[r[1] is target for r in rows].index(True)] == alone


def test_seeded_draw_depends_only_on_seed_and_output_index():
    rng = np.random.default_rng(3)
    logits = random_logits(rng, 30)
    params = [SamplingParams(seed=7)]
    sampler = Sampler()
    for length in range(25):
        histories = [list(rng.integers(0, 30, length)) for _ in range(3)]
        tokens = {sampler.sample(logits, params, [[]], [history])[0].token_id for history in histories}
        assert len(tokens) == 1  # the history's contents do not matter without penalties, only its length


@pytest.mark.parametrize("vocab_size", [1, 7, 13])
def test_seeded_token_follows_the_documented_pipeline_and_philox_noise(vocab_size):
    rng, seeds = np.random.default_rng(vocab_size), random.Random(vocab_size)
    sampler = Sampler(seed=0)
    for case in range(40):
        logits = random_logits(rng, vocab_size)[0]
        params = SamplingParams(
            seed=seeds.randrange(-(2**63), 2**64),
            temperature=float(rng.uniform(0.3, 2.0)),
            top_k=int(rng.integers(0, vocab_size + 2)),
            top_p=float(rng.choice([1.0, rng.uniform(0.3, 1.0)])),
            min_p=float(rng.choice([0.0, rng.uniform(0.0, 0.3)])),
            repetition_penalty=float(rng.uniform(0.8, 1.5)),
            presence_penalty=float(rng.uniform(-1, 1)),
            frequency_penalty=float(rng.uniform(-1, 1)),
            logit_bias={int(rng.integers(vocab_size)): float(rng.uniform(-3, 3))},
        )
        prompt = [int(t) for t in rng.integers(0, vocab_size, 5)]
        output = [int(t) for t in rng.integers(0, vocab_size, case % 9)]
        alive, z = support(penalized(logits, params, prompt, output), params)
        u = documented_uniforms(params.seed, len(output), 0, vocab_size)
        expected = max(alive, key=lambda t: z[t] - math.log(-math.log(u[t])))
        got = sampler.sample(logits[None, :], [params], [prompt], [output])[0].token_id
        assert got == expected


def test_unseeded_rows_use_the_engine_stream_in_row_order():
    vocab = 11
    logits = np.random.default_rng(4).normal(size=(5, vocab)).astype(np.float32)
    got = Sampler(seed=2**64 + 17).sample(logits, [SamplingParams()] * 5, [[]] * 5, [[]] * 5)
    for i in range(5):
        u = documented_uniforms(17, i, 1, vocab)
        expected = max(range(vocab), key=lambda t: float(logits[i, t]) - math.log(-math.log(u[t])))
        assert got[i].token_id == expected


def test_unseeded_draws_repeat_for_an_engine_seed_and_differ_across_engine_seeds():
    row = np.zeros(32, dtype=np.float32)
    runs = [list(draw(Sampler(seed=s), row, SamplingParams(), 50)) for s in (8, 8, 9)]
    assert runs[0] == runs[1] != runs[2]


# ---- the distribution ----


def test_chi_square_helper_matches_a_known_quantile():
    assert chi2_sf(24.322, 7) == pytest.approx(1e-3, rel=1e-3)  # the 0.999 quantile of chi-square(7)
    assert chi2_sf(3.841, 1) == pytest.approx(0.05, rel=1e-3)


@pytest.mark.parametrize(
    "params, seeded",
    [(SamplingParams(temperature=0.7), False), (SamplingParams(temperature=0.7, seed=0), True)],
    ids=["engine-stream", "per-request-seeds"],
)
def test_draws_follow_the_tempered_softmax(params, seeded):
    row = [1.0, 0.5, -0.3, 2.0, 0.0, -1.0, 1.5, 0.2]
    num = 20_000
    counts = np.bincount(draw(Sampler(seed=11), row, params, num), minlength=8)
    weights = [math.exp(float(np.float32(v)) / 0.7) for v in row]
    expected = [num * w / sum(weights) for w in weights]
    statistic = sum((c - e) ** 2 / e for c, e in zip(counts, expected, strict=True))
    # The false-failure rate over engine seeds is 1e-3.
    assert chi2_sf(statistic, len(row) - 1) > 1e-3, (counts, expected)


def test_draws_follow_the_renormalised_softmax_of_the_survivors():
    row = [2.0, 1.6, 1.2, 0.9, 0.3, 0.1, -0.4, -2.0]
    params = SamplingParams(temperature=0.9, top_k=6, top_p=0.9)
    alive, z = support(row, params)
    assert alive == {0, 1, 2, 3, 4}
    num = 10_000
    counts = np.bincount(draw(Sampler(seed=12), row, params, num), minlength=8)
    weights = {t: math.exp(z[t]) for t in alive}
    statistic = sum(
        (counts[t] - num * w / sum(weights.values())) ** 2 / (num * w / sum(weights.values()))
        for t, w in weights.items()
    )
    assert counts[sorted(set(range(8)) - alive)].sum() == 0
    assert chi2_sf(statistic, len(alive) - 1) > 1e-3, counts


# ---- top-k, top-p, min-p: exactly the right support ----

SUPPORT_ROW = [2.0, 1.7, 1.7, 1.4, 1.2, 0.9, 0.6, 0.3, 0.0, -0.3, -0.6, -1.0]

SUPPORT_CASES = {
    "top_k": (SamplingParams(top_k=4), {0, 1, 2, 3}),
    "top_k keeps ties with the k-th": (SamplingParams(top_k=2), {0, 1, 2}),
    "top_k beyond the vocabulary": (SamplingParams(top_k=500), set(range(12))),
    "top_p": (SamplingParams(top_p=0.6), {0, 1, 2, 3}),
    "top_p small keeps the top token": (SamplingParams(top_p=0.01), {0}),
    "min_p": (SamplingParams(min_p=0.4), {0, 1, 2, 3, 4}),
    "min_p sees the temperature": (SamplingParams(min_p=0.4, temperature=2.0), set(range(8))),
    "min_p before top_k and top_p": (SamplingParams(min_p=0.2, top_k=4, top_p=0.75), {0, 1, 2}),
    "all three at once": (SamplingParams(temperature=1.5, min_p=0.05, top_k=7, top_p=0.9), {0, 1, 2, 3, 4, 5}),
}


@pytest.mark.parametrize("params, expected", SUPPORT_CASES.values(), ids=SUPPORT_CASES.keys())
def test_filters_keep_exactly_the_documented_support(params, expected):
    alive, _ = support(SUPPORT_ROW, params)
    assert alive == expected  # the hand-written expectation agrees with the plain-Python reading of the rules
    seen = set(draw(Sampler(seed=13), SUPPORT_ROW, params, 3000).tolist())
    assert seen == expected  # never outside the support, and every token inside it is reached


def test_filters_apply_in_the_documented_order():
    # Probabilities 0.4, 0.3, 0.2, 0.1: min_p and top_k each renormalise what top_p then sees.
    row = np.log(np.array([0.4, 0.3, 0.2, 0.1]))
    z = apply_min_p(row.copy(), 0.3)
    assert np.isinf(z[3]) and not np.isinf(z[:3]).any()
    assert np.isfinite(apply_top_p(z, 0.75)).sum() == 2  # 0.44 + 0.33 of the survivors reach 0.75
    assert np.isfinite(apply_top_p(row.copy(), 0.75)).sum() == 3  # 0.4 + 0.3 of the whole do not
    assert np.isfinite(apply_top_p(apply_top_k(row.copy(), 3), 0.75)).sum() == 2
    params = SamplingParams(min_p=0.3, top_p=0.75)
    assert set(draw(Sampler(seed=14), row, params, 500).tolist()) == {0, 1}
    params = SamplingParams(top_k=3, top_p=0.75)
    assert set(draw(Sampler(seed=14), row, params, 500).tolist()) == {0, 1}


def test_top_k_and_top_p_match_plain_python_on_random_rows():
    rng = np.random.default_rng(5)
    for _ in range(200):
        row = rng.normal(0, 2, size=int(rng.integers(1, 40)))
        params = SamplingParams(
            top_k=int(rng.integers(0, 45)),
            top_p=float(rng.uniform(0.05, 1.0)),
            min_p=float(rng.choice([0.0, rng.uniform(0, 0.5)])),
        )
        expected, _ = support(list(row), params)
        z = apply_top_p(apply_top_k(apply_min_p(row.copy(), params.min_p), params.top_k), params.top_p)
        assert set(np.flatnonzero(np.isfinite(z)).tolist()) == expected
        assert np.array_equal(z[np.isfinite(z)], row[np.isfinite(z)])  # survivors keep their logits


# ---- penalties, bias, bans ----


def test_penalties_change_logits_exactly_as_the_formulas_say():
    rng = np.random.default_rng(6)
    for _ in range(50):
        vocab = 60
        logits = rng.normal(0, 3, size=vocab).astype(np.float32)
        params = SamplingParams(
            repetition_penalty=float(rng.uniform(0.5, 2.0)),
            presence_penalty=float(rng.uniform(-2, 2)),
            frequency_penalty=float(rng.uniform(-2, 2)),
        )
        prompt = [int(t) for t in rng.integers(0, vocab, 20)]
        output = [int(t) for t in rng.integers(0, vocab, 15)]
        got = apply_penalties(logits.astype(np.float64), params, np.array(prompt), output)
        assert got.tolist() == penalized(logits, params, prompt, output)


def test_frequency_and_presence_count_output_tokens_only():
    logits = np.zeros(4)
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    got = apply_penalties(logits, params, prompt_ids=[0, 0, 1], output_ids=[1, 2, 2, 2])
    assert got.tolist() == [0.0, -0.75, -1.75, 0.0]


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = np.array([2.0, -2.0, 2.0, -2.0, 0.0])
    got = apply_penalties(logits, SamplingParams(repetition_penalty=2.0), prompt_ids=[0, 1], output_ids=[4, 4])
    assert got.tolist() == [1.0, -4.0, 2.0, -2.0, 0.0]


def test_a_huge_repetition_penalty_sends_negative_logits_to_minus_infinity_without_a_warning():
    logits = np.array([2.0, -2.0, 1.0], dtype=np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an overflow warning here reached the server's log for a hostile request
        got = apply_penalties(logits, SamplingParams(repetition_penalty=1e308), prompt_ids=[0, 1], output_ids=[])
    assert got[1] == -np.inf and 0 <= float(got[0]) < 1e-30 and got[2] == 1.0


def test_sampler_applies_bias_bans_and_penalties_before_choosing():
    rng = np.random.default_rng(7)
    sampler = Sampler(seed=0)
    for _ in range(100):
        vocab = 30
        logits = rng.normal(0, 1, size=(1, vocab)).astype(np.float32)
        params = SamplingParams(
            temperature=0,
            repetition_penalty=1.7,
            presence_penalty=0.6,
            frequency_penalty=0.4,
            logit_bias={int(t): float(rng.uniform(-2, 2)) for t in rng.integers(0, vocab, 4)},
        )
        prompt = [int(t) for t in rng.integers(0, vocab, 10)]
        output = [int(t) for t in rng.integers(0, vocab, 10)]
        banned = {int(t) for t in rng.integers(0, vocab, 3)} | {vocab + 5, -1}
        expected = penalized(logits[0], params, prompt, output, banned)
        got = sampler.sample(logits, [params], [prompt], [output], [banned])[0].token_id
        assert got == expected.index(max(expected))


def test_logit_bias_moves_the_choice():
    logits = np.array([[1.0, 0.0, 0.5]], dtype=np.float32)
    params = [SamplingParams(temperature=0, logit_bias={1: 1.5, 0: -0.25})]
    assert Sampler().sample(logits, params, [[]], [[]])[0].token_id == 1
    with pytest.raises(InferoError, match="outside the vocabulary"):
        Sampler().sample(logits, [SamplingParams(logit_bias={3: 1.0})], [[]], [[]])


def test_banned_ids_are_never_sampled():
    row = [5.0, 4.0, 0.0, 0.0]
    tokens = draw(Sampler(seed=15), row, SamplingParams(seed=0), 2000, banned={0, 3})
    assert set(tokens.tolist()) == {1, 2}
    greedy = Sampler().sample(np.array([row], dtype=np.float32), [SamplingParams(temperature=0)], [[]], [[]], [{0}])
    assert greedy[0].token_id == 1
    with pytest.raises(InferoError, match="no token can be sampled"):
        Sampler().sample(np.array([row], dtype=np.float32), [SamplingParams()], [[]], [[]], [{0, 1, 2, 3}])


# ---- logprobs ----


def test_logprobs_are_the_raw_log_softmax_of_the_model_logits():
    rng = np.random.default_rng(8)
    logits = random_logits(rng, 50, num_seqs=3)
    params = [
        SamplingParams(logprobs=5, temperature=0.5, top_k=3, repetition_penalty=1.5, logit_bias={0: 5.0}),
        SamplingParams(logprobs=0, temperature=0),
        SamplingParams(logprobs=20, seed=3, presence_penalty=1.0),
    ]
    results = Sampler(seed=0).sample(logits, params, [[0, 1, 2]] * 3, [[3, 4]] * 3)
    for row, (result, p) in enumerate(zip(results, params, strict=True)):
        reference = log_softmax([float(v) for v in logits[row]])
        assert result.logprob == pytest.approx(reference[result.token_id], abs=1e-9)
        ranked = sorted(range(50), key=lambda t: -reference[t])[: p.logprobs]
        assert [t for t, _ in result.top_logprobs] == ranked
        assert [v for _, v in result.top_logprobs] == pytest.approx([reference[t] for t in ranked], abs=1e-9)
    assert results[1].top_logprobs == []


def test_top_logprobs_break_ties_towards_the_lower_id():
    logits = np.array([[0.0, 1.0, 1.0, 2.0, 1.0]], dtype=np.float32)
    result = Sampler().sample(logits, [SamplingParams(temperature=0, logprobs=3)], [[]], [[]])[0]
    assert [t for t, _ in result.top_logprobs] == [3, 1, 2]
    assert result == SampleResult(3, result.logprob, result.top_logprobs)


# ---- validation ----


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.1}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {5: 101.0}}, "logit_bias"),
        ({"seed": 1.5}, "seed"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": 10, "max_tokens": 5}, "min_tokens"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-3]}, "stop_token_ids"),
        ({"n": 0}, "n must"),
    ],
)
def test_out_of_range_parameters_are_rejected_with_the_name(kwargs, message):
    with pytest.raises(InferoError, match=message):
        SamplingParams(**kwargs)


def test_defaults_and_normalisation():
    params = SamplingParams(stop="###", top_k=-1)
    assert params.stop == ["###"] and not params.greedy
    assert SamplingParams().max_tokens == 256 and SamplingParams().n == 1


def test_an_allowed_mask_packed_in_words_masks_as_its_bool_form():
    rng = np.random.default_rng(4)
    for vocab in (31, 32, 33, 1000):
        allowed = rng.random(vocab) < 0.3
        words = np.zeros(-(-vocab // 32), np.uint32)
        for t in np.flatnonzero(allowed):
            words[t // 32] |= np.uint32(1 << (t % 32))
        z = rng.normal(size=vocab)
        expected = np.where(allowed, z, -np.inf)
        assert np.array_equal(apply_allowed_mask(z.copy(), words), expected)
        assert np.array_equal(apply_allowed_mask(z.copy(), words.view(np.int32)), expected)
        assert np.array_equal(apply_allowed_mask(z.copy(), allowed), expected)
    with pytest.raises(ValueError, match="32-bit words"):
        apply_allowed_mask(np.zeros(64), np.zeros(3, np.uint32))
