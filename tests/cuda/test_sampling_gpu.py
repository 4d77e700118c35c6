"""The GPU sampler against the numpy reference `infero.engine.sampling.Sampler`: identical token ids, logprobs within
1e-5. The first tests need no GPU: they pin the host-side packing and the Philox constants the kernel uses.
GPU tests print one line per case (and every mismatch in detail), so one batch run on the GPU machine says
what went wrong."""

from __future__ import annotations

import math
import re
import time

import numpy as np
import pytest

from infero.backends.cuda import compiler
from infero.backends.cuda.sampling import (
    MOD_BANNED,
    MOD_BIAS,
    MOD_SEEN,
    ROW_FREQ_PRES,
    ROW_GREEDY,
    ROW_REPETITION,
    ROW_TEMPERATURE,
    GpuSampler,
    pack_mask,
    pack_modifiers,
)
from infero.engine.sampling import (
    Sampler,
    SamplingError,
    SamplingParams,
    apply_allowed_mask,
    apply_banned,
    apply_logit_bias,
    apply_min_p,
    apply_penalties,
    apply_temperature,
    apply_top_k,
    apply_top_p,
    philox_uniforms,
)

ENGINE_SEED = 20240607
_M64 = (1 << 64) - 1


# ---- host side: no GPU ------------------------------------------------------------------------------------------


def _philox_constants() -> dict[str, int]:
    source = (compiler.KERNEL_DIR / "sampling.cu").read_text()
    return {name: int(value, 16) for name, value in re.findall(r"(PHILOX_[MW][01]) = (0x[0-9A-Fa-f]+)ull", source)}


def _philox_block(c0: int, c1: int, c2: int, key: int, k: dict[str, int]) -> list[int]:
    """sampling.cu's philox4x64_10, line for line, in Python integers."""
    x = [c0, c1, c2, 0]
    k0, k1 = key, 0
    for r in range(10):
        if r > 0:
            k0, k1 = (k0 + k["PHILOX_W0"]) & _M64, (k1 + k["PHILOX_W1"]) & _M64
        p0, p1 = k["PHILOX_M0"] * x[0], k["PHILOX_M1"] * x[2]
        x = [(p1 >> 64) ^ x[1] ^ k0, p1 & _M64, (p0 >> 64) ^ x[3] ^ k1, p0 & _M64]
    return x


def test_kernel_philox_is_numpys_philox_with_the_reference_counters():
    k = _philox_constants()
    assert len(k) == 4
    for key, index, stream in [(0, 0, 0), (123, 7, 0), (2**64 - 1, 2**40 + 3, 1), (ENGINE_SEED, 0, 1)]:
        u_ref = philox_uniforms(key, index, stream, 41)
        raw = [lane for j in range(11) for lane in _philox_block(j, index, stream, key % 2**64, k)][:41]
        u = np.array([((r >> 12) + 0.5) * 2.0**-52 for r in raw])
        assert np.array_equal(u, u_ref), (key, index, stream)


def _emulate_z(logits_row, params, mods, allowed):
    """What sampler_modify + sampler_prepare compute (before the temperature), with numpy's IEEE float64 ops."""
    z = logits_row.astype(np.float64)
    if allowed is not None:
        z[~allowed] = -np.inf
    for m in mods:
        t, zt = int(m["id"]), z[int(m["id"])]
        if m["flags"] & MOD_BIAS:
            zt = zt + m["bias"]
        if m["flags"] & MOD_BANNED:
            zt = -np.inf
        if params.repetition_penalty != 1.0 and m["flags"] & MOD_SEEN:
            zt = zt / params.repetition_penalty if zt > 0 else zt * params.repetition_penalty
        if m["count"] > 0 and (params.frequency_penalty or params.presence_penalty):
            zt = zt - params.frequency_penalty * float(m["count"])
            zt = zt - params.presence_penalty
        z[t] = zt
    return z


def _random_params(rng, vocab, greedy_share=0.2) -> SamplingParams:
    pick = lambda options: options[int(rng.integers(len(options)))]  # noqa: E731
    bias = None
    if rng.random() < 0.3:
        ids = rng.choice(vocab, size=int(rng.integers(1, 8)), replace=False)
        bias = {int(t): float(pick([rng.uniform(-5, 5), 100.0, -100.0, 0.5])) for t in ids}
    return SamplingParams(
        temperature=0.0 if rng.random() < greedy_share else float(pick([1.0, 0.7, 0.3, 1.4, 1e-6, 2.5])),
        top_k=int(pick([0, 0, -1, 1, 2, 20, 50, 300, vocab - 1, vocab, vocab + 5])),
        top_p=float(pick([1.0, 1.0, 0.95, 0.8, 0.5, 0.1, 0.01])),
        min_p=float(pick([0.0, 0.0, 0.05, 0.3])),
        repetition_penalty=float(pick([1.0, 1.0, 1.3, 0.8])),
        presence_penalty=float(pick([0.0, 0.0, 0.4, -1.0])),
        frequency_penalty=float(pick([0.0, 0.0, 0.5, -0.7])),
        logit_bias=bias,
        seed=None if rng.random() < 0.5 else int(rng.integers(-(2**40), 2**63)),
        logprobs=pick([None, None, 0, 3, 20]),
    )


def _random_context(rng, vocab, max_prompt):
    prompt = rng.integers(0, vocab, int(rng.integers(0, max_prompt))).tolist()
    output = rng.integers(0, vocab, int(rng.integers(0, 30))).tolist()
    if output and rng.random() < 0.5:
        output += output[: len(output) // 2]  # repeats: counts > 1
    banned = None
    if rng.random() < 0.2:
        banned = set(rng.integers(0, vocab, 4).tolist()) | {vocab + 3}  # ids past the vocabulary are ignored
    mask = None
    if rng.random() < 0.2:
        mask = rng.random(vocab) < float(rng.choice([0.5, 0.02]))
        mask[rng.integers(0, vocab, 3)] = True
        if banned:
            mask[[t for t in range(vocab) if t not in banned][:2]] = True
    return prompt, output, banned, mask


def test_modifiers_reproduce_reference_steps_1_to_5_bitwise():
    rng = np.random.default_rng(1)
    vocab = 500
    for case in range(300):
        params = _random_params(rng, vocab, greedy_share=0.0)
        prompt, output, banned, mask = _random_context(rng, vocab, 60)
        logits = (rng.standard_normal(vocab) * 3).astype(np.float32)
        mods = pack_modifiers(params, prompt, output, banned, vocab)
        assert np.all(np.diff(mods["id"]) > 0), "modifier ids must be distinct and sorted"
        ref = logits.astype(np.float64)
        ref = apply_allowed_mask(ref, mask)
        ref = apply_logit_bias(ref, params.logit_bias)
        ref = apply_banned(ref, banned)
        ref = apply_penalties(ref, params, prompt, output)
        got = _emulate_z(logits, params, mods, mask)
        assert np.array_equal(got, ref), f"case {case}: {params}"


def test_pack_sets_flags_counters_and_masks_like_the_reference():
    vocab = 100
    sampler = GpuSampler.__new__(GpuSampler)  # host-side packing only: no device buffers
    sampler.vocab_size, sampler.max_rows, sampler.mask_words = vocab, 8, 4
    sampler.engine_key, sampler.num_engine_draws = 77, 5
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.2),
        SamplingParams(temperature=0.7, top_k=vocab, seed=2**64 + 9),
        SamplingParams(temperature=1.0, top_k=3, min_p=0.1, frequency_penalty=0.5, logprobs=2),
        SamplingParams(temperature=1.0, presence_penalty=0.5),
    ]
    mask = np.zeros(vocab, bool)
    mask[[1, 33, 99]] = True
    step = sampler.pack(params, [[1, 2], [], [5], [6]], [[3], [4, 4], [], []], allowed_masks=[None, None, mask, None],
                        logit_rows=[0, 0, 1, 2])  # fmt: skip
    rows = step.rows
    assert rows["flags"][0] == ROW_GREEDY | ROW_REPETITION
    assert rows["flags"][1] == ROW_TEMPERATURE and rows["top_k"][1] == 0  # top_k >= vocab is off
    assert (rows["key"][1], rows["counter"][1], rows["stream"][1]) == (9, 2, 0)  # seeded: (seed, output index)
    assert (rows["key"][2], rows["counter"][2], rows["stream"][2]) == (77, 5, 1)  # engine: draw number
    assert (rows["key"][3], rows["counter"][3]) == (77, 6) and sampler.num_engine_draws == 7
    assert rows["flags"][2] & ROW_FREQ_PRES == 0  # empty output: no penalty
    assert rows["top_k"][2] == 3 and rows["log_min_p"][2] == math.log(0.1) and rows["num_logprobs"][2] == 2
    assert list(rows["mask_row"]) == [-1, -1, 0, -1] and list(rows["logit_row"]) == [0, 0, 1, 2]
    words = step.masks[0]
    assert [t for t in range(vocab) if (words[t // 32] >> (t % 32)) & 1] == [1, 33, 99]
    assert np.array_equal(pack_mask(words.view(np.int32), vocab), words)
    assert list(step.modifiers["id"][rows["mod_begin"][0] : rows["mod_end"][0]]) == [1, 2, 3]


# ---- GPU ----------------------------------------------------------------------------------------------------------


def _logits_rows(rng, n, vocab, style):
    if style == "normal":
        x = rng.standard_normal((n, vocab)) * rng.choice([1.0, 3.0, 8.0], size=(n, 1))
    elif style == "peaked":
        x = rng.standard_normal((n, vocab)) * 2
        x[np.arange(n), rng.integers(0, vocab, n)] += 25
    elif style == "ties":  # many exactly equal logits: the tie rules of top_k, top_p and argmax
        x = np.round(rng.standard_normal((n, vocab)) * 2, 1)
    elif style == "coarse_ties":  # tie groups larger than the sort buffer: the radix descent on ids
        x = np.round(rng.standard_normal((n, vocab)) * 2)
    elif style == "flat":  # one dense bucket: the radix descent on the z key
        x = rng.standard_normal((n, vocab)) * 1e-4
    else:
        raise ValueError(style)
    return x.astype(np.float32)


def _describe(p: SamplingParams) -> str:
    parts = [f"T={p.temperature:g}"]
    for name, off in (("top_k", 0), ("top_p", 1.0), ("min_p", 0.0), ("repetition_penalty", 1.0),
                      ("presence_penalty", 0.0), ("frequency_penalty", 0.0)):  # fmt: skip
        if getattr(p, name) != off:
            parts.append(f"{name}={getattr(p, name):g}")
    if p.logit_bias:
        parts.append(f"bias={len(p.logit_bias)}")
    parts.append("seed" if p.seed is not None else "engine")
    if p.logprobs is not None:
        parts.append(f"logprobs={p.logprobs}")
    return " ".join(parts)


def _reference_detail(logits_row, p, prompt, output, banned, mask, output_index, draw, tokens):
    """Why two tokens may differ: the reference's support and each token's z and noisy score."""
    z = logits_row.astype(np.float64)
    z = apply_penalties(apply_banned(apply_logit_bias(apply_allowed_mask(z, mask), p.logit_bias), banned), p, prompt,
                        output)  # fmt: skip
    if p.greedy:
        return {t: f"z={z[t]!r}" for t in tokens}
    z = apply_top_p(apply_top_k(apply_min_p(apply_temperature(z, p.temperature), p.min_p), p.top_k), p.top_p)
    if p.seed is not None:
        u = philox_uniforms(p.seed, output_index, 0, z.shape[0])
    else:
        u = philox_uniforms(ENGINE_SEED, draw, 1, z.shape[0])
    score = z - np.log(-np.log(u))
    support = int(np.isfinite(z).sum())
    return {"support": support} | {t: f"z={z[t]!r} score={score[t]!r}" for t in tokens if 0 <= t < z.shape[0]}


def _compare(name, logits, params, prompts, outputs, banned, masks, batch_sizes, max_rows=64):
    """Sample the rows in batches with both samplers; print every mismatch; return the counts."""
    from infero.backends.cuda.tensor import from_host

    vocab = logits.shape[1]
    ref_sampler, gpu_sampler = Sampler(ENGINE_SEED), GpuSampler(vocab, max_rows, seed=ENGINE_SEED)
    mismatches, lp_errors, worst_lp, start, b = [], [], 0.0, 0, 0
    while start < len(params):
        end = min(len(params), start + batch_sizes[b % len(batch_sizes)])
        b += 1
        sl = slice(start, end)
        draws_before = ref_sampler.num_engine_draws
        ref = ref_sampler.sample(logits[sl], params[sl], prompts[sl], outputs[sl], banned[sl], masks[sl])
        got = gpu_sampler.sample(from_host(logits[sl]), params[sl], prompts[sl], outputs[sl], banned[sl], masks[sl])
        draw = draws_before
        for i, (r, g) in enumerate(zip(ref, got, strict=True)):
            row, p = start + i, params[start + i]
            if r.token_id != g.token_id:
                detail = _reference_detail(logits[row], p, prompts[row], outputs[row], banned[row], masks[row],
                                           len(outputs[row]), draw, (r.token_id, g.token_id))  # fmt: skip
                mismatches.append(row)
                print(f"  MISMATCH {name} row {row}: ref {r.token_id} gpu {g.token_id} [{_describe(p)}] {detail}")
            if p.logprobs is not None:
                err = abs(r.logprob - g.logprob)
                ids_ok = [t for t, _ in r.top_logprobs] == [t for t, _ in g.top_logprobs]
                val_err = max([abs(a[1] - c[1]) for a, c in zip(r.top_logprobs, g.top_logprobs, strict=True)] or [0])
                worst_lp = max(worst_lp, err, val_err)
                if err > 1e-5 or val_err > 1e-5 or not ids_ok:
                    lp_errors.append(row)
                    print(f"  LOGPROB {name} row {row}: err {err:.2e} top err {val_err:.2e} ids equal {ids_ok} "
                          f"ref {r.top_logprobs[:4]} gpu {g.top_logprobs[:4]}")  # fmt: skip
            if not p.greedy and p.seed is None:
                draw += 1
        start = end
    print(f"{name}: {len(params)} rows, {len(mismatches)} token mismatches, {len(lp_errors)} logprob errors, "
          f"worst logprob error {worst_lp:.2e}; engine draws ref {ref_sampler.num_engine_draws} gpu "
          f"{gpu_sampler.num_engine_draws}")  # fmt: skip
    assert ref_sampler.num_engine_draws == gpu_sampler.num_engine_draws
    return mismatches, lp_errors


@pytest.mark.gpu
@pytest.mark.parametrize("vocab,num_rows,max_prompt", [(1000, 600, 80), (151936, 160, 3000)])
def test_sampler_matches_numpy_on_random_rows_and_parameters(gpu, vocab, num_rows, max_prompt):
    rng = np.random.default_rng(vocab)
    styles = ["normal", "normal", "peaked", "ties"]
    logits = np.concatenate([_logits_rows(rng, 1, vocab, styles[i % len(styles)]) for i in range(num_rows)])
    params = [_random_params(rng, vocab) for _ in range(num_rows)]
    contexts = [_random_context(rng, vocab, max_prompt) for _ in range(num_rows)]
    prompts, outputs, banned, masks = (list(c) for c in zip(*contexts, strict=True))
    t0 = time.perf_counter()
    mismatches, lp_errors = _compare(f"V={vocab}", logits, params, prompts, outputs, banned, masks, [1, 7, 32, 13])
    print(f"  ({time.perf_counter() - t0:.1f} s)")
    assert not mismatches and not lp_errors


@pytest.mark.gpu
@pytest.mark.parametrize("style", ["ties", "coarse_ties", "flat", "peaked"])
@pytest.mark.parametrize("vocab", [1000, 151936])
def test_sampler_top_k_top_p_min_p_grid_matches_numpy(gpu, vocab, style):
    """Every filter combination on rows that stress the selection: exact ties, one dense bucket, one huge logit."""
    rng = np.random.default_rng(vocab + len(style))
    params = []
    for top_k in (0, 1, 7, 1000, 5000):
        for top_p in (1.0, 0.9, 0.5, 0.05):
            for min_p in (0.0, 0.1):
                for temperature in (1.0, 0.5):
                    seed = int(rng.integers(0, 2**32)) if len(params) % 2 else None
                    params.append(SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                                 seed=seed))  # fmt: skip
    n = len(params)
    logits = _logits_rows(rng, n, vocab, style)
    none = [None] * n
    mismatches, _ = _compare(f"grid {style} V={vocab}", logits, params, [[]] * n, [[]] * n, none, none, [16, 5])
    assert not mismatches


@pytest.mark.gpu
def test_sampler_masks_bans_and_shared_logits_rows(gpu):
    from infero.backends.cuda.tensor import from_host

    vocab = 151936
    rng = np.random.default_rng(3)
    logits = _logits_rows(rng, 2, vocab, "normal")
    mask = np.zeros(vocab, bool)
    mask[[5, 77, 150000]] = True
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=1),
              SamplingParams(temperature=1.0, seed=1), SamplingParams(temperature=1.0, seed=2, top_p=0.5)]  # fmt: skip
    rows = [1, 1, 0, 1]
    ref = Sampler(ENGINE_SEED).sample(logits[rows], params, [[]] * 4, [[]] * 4, [None, {77}, None, None],
                                      [mask, mask, None, mask])  # fmt: skip
    gpu_sampler = GpuSampler(vocab, 8, seed=ENGINE_SEED)
    got = gpu_sampler.sample(from_host(logits), params, [[]] * 4, [[]] * 4, [None, {77}, None, None],
                             [mask, mask, None, mask], logit_rows=rows)  # fmt: skip
    print("masks/bans/shared rows:", [r.token_id for r in ref], [g.token_id for g in got])
    assert [r.token_id for r in ref] == [g.token_id for g in got]
    all_banned = [SamplingParams(temperature=1.0)]
    with pytest.raises(SamplingError, match="no token can be sampled"):
        gpu_sampler.sample(from_host(logits[:1]), all_banned, [[]], [[]], [{5}], [mask & (np.arange(vocab) == 5)])
    # The self-cleaning scratch is clean again: the next step still matches.
    again = gpu_sampler.sample(from_host(logits), params, [[]] * 4, [[]] * 4, None, None, logit_rows=rows)
    ref2 = Sampler(ENGINE_SEED).sample(logits[rows], params, [[]] * 4, [[]] * 4)
    assert [r.token_id for r in ref2] == [g.token_id for g in again]


@pytest.mark.gpu
def test_a_row_with_a_non_finite_logit_gets_the_non_finite_token_and_the_others_sample_as_numpy(gpu):
    from infero.backends.cuda.tensor import from_host
    from infero.engine.sampling import NON_FINITE_LOGITS

    vocab = 151936
    rng = np.random.default_rng(5)
    logits = _logits_rows(rng, 4, vocab, "normal")
    logits[1, 4321] = np.nan
    logits[3, 150000] = np.inf
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.0, seed=3, logprobs=2), SamplingParams(temperature=1.0, seed=4)]  # fmt: skip
    ref = Sampler(ENGINE_SEED).sample(logits, params, [[]] * 4, [[]] * 4)
    got = GpuSampler(vocab, 8, seed=ENGINE_SEED).sample(from_host(logits), params, [[]] * 4, [[]] * 4)
    print("non-finite rows:", [r.token_id for r in ref], [g.token_id for g in got])
    assert [r.token_id for r in ref] == [g.token_id for g in got]
    assert [g.token_id == NON_FINITE_LOGITS for g in got] == [False, True, False, True]


@pytest.mark.gpu
def test_sampler_is_deterministic_and_batch_invariant(gpu):
    from infero.backends.cuda.tensor import from_host

    vocab = 151936
    rng = np.random.default_rng(11)
    logits = _logits_rows(rng, 24, vocab, "normal")
    params = [SamplingParams(temperature=0.8, top_p=0.9, top_k=int(k), seed=int(s), logprobs=5)
              for k, s in zip(rng.integers(0, 100, 24), rng.integers(0, 2**31, 24), strict=True)]  # fmt: skip
    sampler = GpuSampler(vocab, 32, seed=ENGINE_SEED)
    dev = from_host(logits)
    full = sampler.sample(dev, params, [[]] * 24, [[]] * 24)
    again = sampler.sample(dev, params, [[]] * 24, [[]] * 24)
    alone = [sampler.sample(from_host(logits[i : i + 1]), params[i : i + 1], [[]], [[]])[0] for i in (0, 9, 23)]
    assert full == again
    assert [full[i] for i in (0, 9, 23)] == alone


@pytest.mark.gpu
def test_sampler_run_replays_in_a_cuda_graph(gpu):
    """run() is capturable: capture once, upload a different step, replay: the tokens of an eager launch."""
    from infero.backends.cuda import driver, runtime
    from infero.backends.cuda.tensor import from_host

    vocab, rows = 151936, 8
    rng = np.random.default_rng(21)
    logits = from_host(_logits_rows(rng, rows, vocab, "normal"))
    stream = runtime.stream()
    sampler = GpuSampler(vocab, rows, seed=ENGINE_SEED)
    steps = [
        sampler.pack([_random_params(rng, vocab) for _ in range(rows)], [[1, 2, 3]] * rows, [[4, 4]] * rows)
        for _ in range(2)
    ]
    sampler.launch(logits, steps[0], stream)
    sampler.collect(steps[0], stream)
    graph = driver.Graph(stream, lambda: sampler.run(logits, rows, stream))
    sampler.upload(steps[1], stream)
    graph.replay(stream)
    replayed = sampler.collect(steps[1], stream)
    sampler.launch(logits, steps[1], stream)
    eager = sampler.collect(steps[1], stream)
    print("graph replay:", [r.token_id for r in replayed], "eager:", [r.token_id for r in eager])
    assert replayed == eager


@pytest.mark.gpu
def test_sampler_speed(gpu):
    """Not an assertion: GPU microseconds per sampling step on V = 151,936 (a replayed CUDA graph of run()),
    host microseconds of pack() and upload(), and a per-kernel split at 128 rows (eager, events)."""
    from cuda.bindings import driver as cu

    from infero.backends.cuda import driver, runtime
    from infero.backends.cuda.tensor import from_host

    vocab = 151936
    rng = np.random.default_rng(5)
    stream = runtime.stream()
    for name in ("sampler_select", "sampler_histogram", "sampler_gumbel", "sampler_prepare"):
        fn = runtime.kernel("sampling.cu", name)
        regs, local = (
            driver.check(cu.cuFuncGetAttribute(getattr(cu.CUfunction_attribute, a), fn))
            for a in ("CU_FUNC_ATTRIBUTE_NUM_REGS", "CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES")
        )
        print(f"{name}: {regs} registers, {local} bytes of local memory")
    cases = {
        "greedy": SamplingParams(temperature=0.0),
        "T=1": SamplingParams(temperature=1.0),
        "T=0.7 top_p=0.9": SamplingParams(temperature=0.7, top_p=0.9),
        "T=0.7 top_k=20 top_p=0.8": SamplingParams(temperature=0.7, top_k=20, top_p=0.8),
        "min_p=0.1": SamplingParams(temperature=1.0, min_p=0.1),
        "T=1 rep=1.1 logprobs=5": SamplingParams(temperature=1.0, repetition_penalty=1.1, logprobs=5),
    }
    kernels = ("modify", "prepare", "histogram", "select", "gumbel", "finalize")
    for style in ("normal", "peaked"):
        for rows in (1, 32, 128):
            logits = from_host(_logits_rows(rng, rows, vocab, style))
            sampler = GpuSampler(vocab, rows, seed=1)
            for name, p in cases.items():
                prompts = [rng.integers(0, vocab, 500).tolist() for _ in range(rows)]
                t0 = time.perf_counter()
                step = sampler.pack([p] * rows, prompts, [[1, 2, 3]] * rows)
                t1 = time.perf_counter()
                sampler.upload(step, stream)
                t2 = time.perf_counter()
                sampler.run(logits, rows, stream)
                stream.synchronize()
                graph = driver.Graph(stream, lambda s=sampler, lg=logits, n=rows: s.run(lg, n, stream))
                start, end = driver.Event(), driver.Event()
                start.record(stream)
                for _ in range(20):
                    graph.replay(stream)
                end.record(stream)
                end.synchronize()
                us = end.elapsed_ms(start) * 1e3 / 20
                split = ""
                if rows == 128:
                    events = [driver.Event() for _ in range(7)]
                    sampler.run(logits, rows, stream, events=events)
                    events[6].synchronize()
                    split = " ".join(
                        f"{k} {events[i + 1].elapsed_ms(events[i]) * 1e3:.0f}" for i, k in enumerate(kernels)
                    )
                print(
                    f"sampler {style:6s} S={rows:4d} {name:26s} GPU {us:8.1f} us ({us / rows:6.2f}/row), host pack "
                    f"{(t1 - t0) * 1e6:7.0f} us upload {(t2 - t1) * 1e6:5.0f} us {split}"
                )
