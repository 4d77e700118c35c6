"""The delta rule op on the GPU (CudaOps.gated_delta_rule): each sequence's whole 64-position chunks by
kernels/delta_rule_chunked.cu, its other tokens by delta_net.cu's recurrent gated_delta_rule (part head before the
chunks, tail after), against numpy's recurrent form; and its batch invariance bitwise. The launchers' checks and
the op's launches run without a GPU.

Bound: the chunked form is a different order of the same sums, in 3xTF32 (tests/cpu/test_delta_rule_chunked.py
puts a numpy transcription of it within 2e-6 of the float64 rule, and fp32's recurrent form within 5e-7): 2e-5 of
the sequence's largest |o| (and of its final state's largest element), on inputs as the model feeds them (q, k
l2-normed, g in [-2, 0), beta in (0, 1)). Every output starts as NaN, so a row no launch writes fails.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from helpers import stand_in as tensor

from infero.backends.cpu.delta_net import l2_norm
from infero.backends.cpu.ops import CpuOps
from infero.backends.cuda import delta_net, delta_rule_chunked
from infero.backends.cuda.ops import CudaOps
from infero.backends.cuda.tensor import columns

NUM_SLOTS, LAYERS, LAYER = 6, 2, 1
BOUND = 2e-5
# (key heads, value heads, d_k, d_v): Qwen3.5's heads (two key heads for four value heads), and d_k 64.
SHAPES = {128: (2, 4, 128, 128), 64: (1, 2, 64, 64)}
# (first position, tokens, slot) of one step's sequences: prompts of 64, 100, 512 and 300 tokens, a step starting
# mid-chunk (24 recurrent tokens, two whole chunks, 48 recurrent), a decode token.
STEP = [(0, 64, 4), (0, 100, 0), (0, 512, 5), (0, 300, 2), (40, 200, 3), (77, 1, 1)]


def _dev(a: np.ndarray):
    from infero.backends.cuda.tensor import from_host

    return from_host(np.ascontiguousarray(a))


def _host(t) -> np.ndarray:
    from infero.backends.cuda import runtime

    return t.to_host(runtime.stream())


def gpu_ops() -> CudaOps:
    """CudaOps whose workspace hands out NaN-filled tensors (and ignores their handing back)."""
    from infero.backends.cuda import runtime

    workspace = SimpleNamespace(empty=lambda shape, dtype: _dev(np.full(shape, np.nan, dtype)), offset=0)
    return CudaOps(SimpleNamespace(workspace=workspace, stream=runtime.stream(), weights_arena=None))


def step_inputs(rng, n: int, d_k: int):
    """q | k | v as the conv output [n, C] (q and k l2-normed per key head), g in [-2, 0), beta in (0, 1)."""
    key_heads, v_heads, _, d_v = SHAPES[d_k]
    qk = l2_norm(rng.normal(0, 1, (n, 2 * key_heads, d_k)).astype(np.float32), 1e-6).reshape(n, -1)
    wide = np.concatenate([qk, rng.normal(0, 1, (n, v_heads * d_v)).astype(np.float32)], axis=1)
    g = -rng.uniform(0, 2, (n, v_heads)).astype(np.float32)
    beta = rng.uniform(0, 1, (n, v_heads)).astype(np.float32)
    return wide, g, beta


def carried_state(rng, d_k: int) -> np.ndarray:
    """delta [slots, layers, value heads, d_k, d_v]: earlier steps' state in every slot."""
    _, v_heads, _, d_v = SHAPES[d_k]
    return rng.normal(0, 0.3, (NUM_SLOTS, LAYERS, v_heads, d_k, d_v)).astype(np.float32)


def step_batch(sequences, device: bool = True):
    """(first position, tokens, slot) per sequence -> the op's batch: query_starts, positions, state_slots (device
    arrays where `device`) and the host's count of whole chunks."""
    starts = np.concatenate([[0], np.cumsum([n for _, n, _ in sequences])]).astype(np.int32)
    positions = np.concatenate([np.arange(p, p + n) for p, n, _ in sequences]).astype(np.int32)
    slots = np.array([s for _, _, s in sequences], np.int32)
    chunks = delta_rule_chunked.whole_chunks(positions, starts)
    arrays = (starts, positions, slots)
    if device:
        arrays = tuple(_dev(a) for a in arrays)
    return SimpleNamespace(query_starts=arrays[0], positions=arrays[1], state_slots=arrays[2],
                           num_whole_chunks=chunks)  # fmt: skip


def gpu_step(wide, g, beta, d_k, state, sequences, pairing="tiled") -> np.ndarray:
    """The op's output for one step; state (device) updated in place."""
    key_heads, v_heads, _, d_v = SHAPES[d_k]
    key = key_heads * d_k
    wide_d = _dev(wide)
    q, k, v = (columns(wide_d, lo, hi) for lo, hi in ((0, key), (key, 2 * key), (2 * key, 2 * key + v_heads * d_v)))
    cache = SimpleNamespace(delta=state)
    out = gpu_ops().gated_delta_rule(q, k, v, _dev(g), _dev(beta), pairing, 1 / np.sqrt(d_k), cache, LAYER,
                                     step_batch(sequences))  # fmt: skip
    return _host(out)


def numpy_step(wide, g, beta, d_k, delta, sequences, pairing="tiled"):
    """CpuOps.gated_delta_rule (token by token) for the step: output, and the state it leaves (delta copied)."""
    key_heads, v_heads, _, d_v = SHAPES[d_k]
    n, key = len(wide), key_heads * d_k
    q, k = (wide[:, lo : lo + key].reshape(n, key_heads, d_k) for lo in (0, key))
    v = wide[:, 2 * key :].reshape(n, v_heads, d_v)
    cache = SimpleNamespace(delta=delta.copy())
    out = CpuOps().gated_delta_rule(q, k, v, g, beta, pairing, 1 / np.sqrt(d_k), cache, LAYER,
                                    step_batch(sequences, device=False))  # fmt: skip
    return out, cache.delta


@pytest.mark.gpu
@pytest.mark.parametrize("d_k", [128, 64])
@pytest.mark.parametrize("pairing", ["tiled", "grouped"])
def test_the_op_matches_numpys_recurrent_form_over_whole_chunks_heads_and_tails(gpu, d_k, pairing):
    rng = np.random.default_rng(d_k)
    n = sum(t for _, t, _ in STEP)
    wide, g, beta = step_inputs(rng, n, d_k)
    delta = carried_state(rng, d_k)
    state = _dev(delta)
    out = gpu_step(wide, g, beta, d_k, state, STEP, pairing)
    expected, expected_state = numpy_step(wide, g, beta, d_k, delta, STEP, pairing)
    after = _host(state)
    lo = 0
    for first, tokens, slot in STEP:
        got, want = out[lo : lo + tokens], expected[lo : lo + tokens]
        assert np.abs(got - want).max() <= BOUND * np.abs(want).max(), f"{tokens} tokens from {first}"
        want_state = expected_state[slot, LAYER]
        assert np.abs(after[slot, LAYER] - want_state).max() <= BOUND * np.abs(want_state).max(), f"slot {slot}"
        lo += tokens
    assert np.array_equal(after[:, 0], delta[:, 0])  # the other layer's state untouched


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [(64,), (128, 256), (64, 128, 256)])
def test_a_prompt_split_at_multiples_of_64_gives_the_same_output_and_state_bits(gpu, splits):
    rng = np.random.default_rng(len(splits))
    total, d_k = 300, 128
    wide, g, beta = step_inputs(rng, total, d_k)
    delta = carried_state(rng, d_k)
    whole_state = _dev(delta)
    whole = gpu_step(wide, g, beta, d_k, whole_state, [(0, total, 1)])

    state = _dev(delta)
    bounds = [0, *splits, total]
    outs = []
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        other, o_g, o_beta = step_inputs(rng, 70, d_k)  # another prompt's tokens beside it, a chunk and a tail
        step_wide, step_g, step_beta = (np.concatenate([a[lo:hi], b]) for a, b in ((wide, other), (g, o_g),
                                                                                   (beta, o_beta)))  # fmt: skip
        out = gpu_step(step_wide, step_g, step_beta, d_k, state, [(lo, hi - lo, 1), (64 * len(outs), 70, 3)])
        outs.append(out[: hi - lo])
    assert np.array_equal(np.concatenate(outs), whole)
    assert np.array_equal(_host(state)[1], _host(whole_state)[1])


@pytest.mark.gpu
def test_a_decode_tokens_bits_are_the_same_beside_another_sequences_whole_chunk_prefill(gpu):
    rng = np.random.default_rng(3)
    d_k = 128
    wide, g, beta = step_inputs(rng, 1 + 150, d_k)
    delta = carried_state(rng, d_k)
    alone_state, beside_state = _dev(delta), _dev(delta)
    alone = gpu_step(wide[:1], g[:1], beta[:1], d_k, alone_state, [(77, 1, 2)])
    beside = gpu_step(wide, g, beta, d_k, beside_state, [(77, 1, 2), (10, 150, 4)])
    assert np.array_equal(beside[:1], alone)
    assert np.array_equal(_host(beside_state)[2], _host(alone_state)[2])


@pytest.mark.gpu
def test_a_sequence_without_a_valid_slot_gets_nan_and_touches_no_state(gpu):
    rng = np.random.default_rng(5)
    d_k = 64
    wide, g, beta = step_inputs(rng, 200 + 100, d_k)
    delta = carried_state(rng, d_k)
    state = _dev(delta)
    out = gpu_step(wide, g, beta, d_k, state, [(40, 200, NUM_SLOTS), (0, 100, 2)])
    assert np.isnan(out[:200]).all() and np.isfinite(out[200:]).all()
    assert np.array_equal(np.delete(_host(state), 2, axis=0), np.delete(delta, 2, axis=0))


# What runs without a GPU: which launches the op makes, the launchers' checks, the kernel's shared memory.


@pytest.fixture
def launches(monkeypatch):
    """driver.launch recorded as (kernel expression, grid, block, part argument or None, shared bytes)."""
    from infero.backends.cuda import driver

    calls = []

    def launch(fn, grid, block, args, types, stream, shared=0, **kw):
        part = args[-1] if fn.startswith("gated_delta_rule") else None
        calls.append((fn, grid, block, part, shared))

    monkeypatch.setattr(driver, "launch", launch)
    monkeypatch.setattr(delta_net, "_kernel", lambda expression: expression)
    monkeypatch.setattr(delta_rule_chunked, "_kernel", lambda expression, shared: expression)
    return calls


def op_call(sequences, d_k=128, d_v=128, key_heads=2, v_heads=4):
    """CudaOps.gated_delta_rule on stand-in tensors for a step of these (first position, tokens, slot)."""
    n = sum(t for _, t, _ in sequences)
    key = key_heads * d_k
    wide = tensor((n, 2 * key + v_heads * d_v))
    q, k, v = columns(wide, 0, key), columns(wide, key, 2 * key), columns(wide, 2 * key, wide.shape[1])
    batch = step_batch(sequences, device=False)
    batch.query_starts, batch.positions, batch.state_slots = (tensor(a.shape, np.int32) for a in (
        batch.query_starts, batch.positions, batch.state_slots))  # fmt: skip
    workspace = SimpleNamespace(empty=lambda shape, dtype: tensor(shape), offset=0)
    ops = CudaOps(SimpleNamespace(workspace=workspace, stream=None, weights_arena=None))
    cache = SimpleNamespace(delta=tensor((8, 2, v_heads, d_k, d_v)))
    ops.gated_delta_rule(q, k, v, tensor((n, v_heads)), tensor((n, v_heads)), "tiled", 0.1, cache, 1, batch)


def test_a_step_with_whole_chunks_runs_head_chunks_and_tail_and_a_decode_step_one_recurrent_launch(launches):
    op_call([(40, 200, 0), (9, 1, 1)])  # 201 tokens: 3 records a value head
    prepare, walk = delta_rule_chunked.prepare_shared_bytes(128), delta_rule_chunked.walk_shared_bytes(128)
    assert launches == [("gated_delta_rule<128>", (16, 2), (128,), 1, 0),
                        ("delta_rule_prepare<128>", (4, 3), (256,), None, prepare),
                        ("delta_rule_chunked<128>", (16, 2), (256,), None, walk),
                        ("gated_delta_rule<128>", (16, 2), (128,), 2, 0)]  # fmt: skip
    launches.clear()
    op_call([(63, 1, 0), (9, 1, 1), (0, 63, 2)])  # no whole chunk: decode tokens, a prompt of 63
    assert launches == [("gated_delta_rule<128>", (16, 3), (128,), 0, 0)]


def test_a_key_dim_without_the_chunked_kernel_runs_every_token_recurrent(launches):
    op_call([(0, 128, 0)], d_k=16, d_v=32)
    assert launches == [("gated_delta_rule<16>", (4, 1), (128,), 0, 0)]


def test_the_chunked_launcher_and_the_parts_refuse_what_their_kernels_cannot_take(launches):
    n, wide = 70, tensor((70, 2 * 32 + 4 * 32))
    q, k, v = columns(wide, 0, 32), columns(wide, 32, 64), columns(wide, 64, 192)
    common = (q, k, v, tensor((n, 4)), tensor((n, 4)), "tiled", 0.1, tensor((8, 2, 4, 16, 32)),
              tensor((2,), np.int32))  # fmt: skip
    with pytest.raises(ValueError, match=r"chunked delta rule is compiled for d_k in \(64, 128\), got 16"):
        delta_rule_chunked.delta_rule_chunked(tensor((n, 4, 32)), *common, tensor((n,), np.int32),
                                              tensor((1,), np.int32), 1, None, None)  # fmt: skip
    with pytest.raises(ValueError, match=r"positions must be int32 \[70\]"):
        delta_net.gated_delta_rule(tensor((n, 4, 32)), *common, tensor((1,), np.int32), 1, None, part="head")
    with pytest.raises(ValueError, match="part must be one of"):
        delta_net.gated_delta_rule(tensor((n, 4, 32)), *common, tensor((1,), np.int32), 1, None, part="middle")
    assert not launches


def test_the_launchers_sizes_are_the_kernels_structs():
    """delta_rule_chunked's shared bytes and record floats against sizeof(drc::Prep<DK>), sizeof(drc::Walk<DK>)
    and drc::Record<DK>::floats, asked of NVRTC (no GPU)."""
    from infero.backends.cuda import compiler

    d = delta_rule_chunked
    source = (compiler.KERNEL_DIR / d.SOURCE).read_text()
    checks = "".join(f"static_assert(sizeof(drc::Prep<{k}>) == {d.prepare_shared_bytes(k)});\n"
                     f"static_assert(sizeof(drc::Walk<{k}>) == {d.walk_shared_bytes(k)});\n"
                     f"static_assert(drc::Record<{k}>::floats({v}) == {d.record_floats(k, v)});\n"
                     for k in d.KEY_DIMS for v in (32, 128))  # fmt: skip
    assert compiler.compile_source(source + checks, delta_rule_chunked.SOURCE, "sm_80").cubin
