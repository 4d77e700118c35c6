"""The Qwen3.5 / Qwen3-Next hybrids on the GPU backend (synthetic tiny models, attention heads of 64): logits track
the numpy backend at every step shape and batch width; a sequence's decode is the same bits beside other sequences,
from a copied state, and in a replayed graph; a state slot reused after an aborted request leaks nothing; forks copy
the state."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_graph_replay_is_eager
from helpers import relative_error as rel_err

BLOCK = 16
VOCAB = 2048
PROMPT = [int(t) for t in np.random.default_rng(5).integers(3, 250, size=150)]
NEAR_TIE = 1e-3  # top-1 may differ only where the reference's top two logits are closer than this


@pytest.fixture(scope="module", params=[("qwen35-tiny", "Q8_0"), ("qwen35moe-tiny", "Q8_0"),
                                        ("qwen35-tiny", "Q4_K_M"), ("qwen3next-tiny", "Q8_0")],
                ids=lambda p: "-".join(p))  # fmt: skip
def hybrid_file(request, tmp_path_factory):
    from infero.checkpoint.synthetic import write_synthetic

    shape, quant = request.param
    return write_synthetic(shape, quant, tmp_path_factory.mktemp("hybrid") / f"{shape}-{quant}.gguf", seed=3)


def loaded(path, device: str):
    from infero.backends import select_backend
    from infero.checkpoint import load_checkpoint
    from infero.engine.engine import EngineConfig
    from infero.models import load_model

    backend = select_backend(device)
    checkpoint = load_checkpoint(path)
    if device == "cuda":
        backend.compile_kernels(checkpoint)
    model = load_model(checkpoint, backend.ops)
    backend.prepare(model.config, EngineConfig(max_num_seqs=64, max_num_batched_tokens=4096))
    return model, backend


def run(model, backend, cache, steps):
    """The step's logits on the host."""
    from infero.engine.batch import build_batch

    batch = build_batch(steps, BLOCK)
    out = backend.forward(model, batch, cache)
    return out if isinstance(out, np.ndarray) else backend.to_host(out, 0, len(batch.logits_indices))


def prefill(model, backend, cache, prompt, chunk, slot=0, first_block=0):
    from infero.engine.batch import SequenceStep

    table, rows = list(range(first_block, first_block + -(-len(prompt) // BLOCK))), []
    for start in range(0, len(prompt), chunk):
        rows.append(run(model, backend, cache, [SequenceStep(prompt[start : start + chunk], start, table, "all",
                                                             state_slot=slot)]))  # fmt: skip
    return np.concatenate(rows)


def agrees_on_top1(out, ref) -> bool:
    top2 = np.sort(ref, axis=-1)[:, -2:]
    return bool(np.all((out.argmax(-1) == ref.argmax(-1)) | (top2[:, 1] - top2[:, 0] < NEAR_TIE)))


@pytest.mark.gpu
def test_a_tiny_hybrid_tracks_the_cpu_backend_at_every_step_shape(gpu, hybrid_file):
    cpu_model, cpu = loaded(hybrid_file, "cpu")
    ref = prefill(cpu_model, cpu, cpu.allocate_kv_cache(cpu_model.config, 10, BLOCK, 1), PROMPT, len(PROMPT))
    model, backend = loaded(hybrid_file, "cuda")
    for chunk in (len(PROMPT), 64, 7, 1):
        out = prefill(model, backend, backend.allocate_kv_cache(model.config, 10, BLOCK, 1), PROMPT, chunk)
        err = rel_err(out, ref)
        print(f"{hybrid_file.name}, chunks of {chunk}: rel err {err:.2e}")
        assert np.isfinite(out).all() and err < 2e-2 and agrees_on_top1(out, ref), chunk


@pytest.mark.gpu
@pytest.mark.parametrize("width", [8, 64])
def test_a_batch_of_mixed_prompts_tracks_the_cpu_backend(gpu, hybrid_file, width):
    """width sequences of 1 to 40 new tokens, half of them continuing an earlier chunk (their state carried), in
    one step, each in its own slot: the last logits of each against numpy's."""
    from infero.engine.batch import SequenceStep

    rng = np.random.default_rng(width)
    prompts = [[int(t) for t in rng.integers(3, 250, size=int(rng.integers(2, 41)))] for _ in range(width)]
    outs = []
    for device in ("cpu", "cuda"):
        model, backend = loaded(hybrid_file, device)
        cache = backend.allocate_kv_cache(model.config, 3 * width, BLOCK, width)
        first = [SequenceStep(p[: len(p) // 2], 0, [3 * s, 3 * s + 1, 3 * s + 2], state_slot=width - 1 - s)
                 for s, p in enumerate(prompts) if s % 2]  # fmt: skip
        run(model, backend, cache, first)
        steps = [SequenceStep(p[len(p) // 2 :] if s % 2 else p, len(p) // 2 if s % 2 else 0,
                              [3 * s, 3 * s + 1, 3 * s + 2], state_slot=width - 1 - s)
                 for s, p in enumerate(prompts)]  # fmt: skip
        outs.append(run(model, backend, cache, steps))
    ref, out = outs
    err = rel_err(out, ref)
    print(f"{hybrid_file.name}, {width} sequences: rel err {err:.2e}")
    assert np.isfinite(out).all() and err < 2e-2 and agrees_on_top1(out, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", ["qwen35-tiny", "qwen35moe-tiny", "qwen3next-tiny"])
def test_decode_beside_seven_others_from_a_copied_state_is_bitwise_decode_alone(gpu, tmp_path, shape):
    """Eight sequences prefilled into slots 0-7 and their states copied to slots 8-15 (copy_state); one decode step
    of all eight from slots 0-7, then each alone from its copy: the same logits bits. Q4_0, whose linear layers take
    the mat-vec at every width up to 16 (Q8_0 and the K-quants change to the skinny GEMM at a few tokens, which is
    not the mat-vec's expression: docs/kernels.md, "Batch invariance")."""
    from infero.checkpoint.synthetic import write_synthetic
    from infero.engine.batch import SequenceStep

    model, backend = loaded(write_synthetic(shape, "Q4_0", tmp_path / "q4_0.gguf", seed=3), "cuda")
    cache = backend.allocate_kv_cache(model.config, 32, BLOCK, 16)
    prompts = [[(7 * i + 13 * j + 1) % 250 for j in range(5 + 3 * i)] for i in range(8)]
    tables = [list(range(4 * i, 4 * i + 4)) for i in range(8)]
    for i, (p, table) in enumerate(zip(prompts, tables, strict=True)):
        run(model, backend, cache, [SequenceStep(p, 0, table, state_slot=i)])
        backend.copy_state(cache, i, 8 + i)
    steps = [SequenceStep([(3 * i) % 250], len(p), t, state_slot=i)
             for i, (p, t) in enumerate(zip(prompts, tables, strict=True))]  # fmt: skip
    together = run(model, backend, cache, steps)
    for i, step in enumerate(steps):
        alone = run(model, backend, cache, [SequenceStep(step.token_ids, step.start_position, step.block_table,
                                                         state_slot=8 + i)])  # fmt: skip
        assert np.array_equal(alone[0], together[i]), f"sequence {i}"


@pytest.mark.gpu
def test_graph_replay_is_bit_identical_to_eager(gpu, hybrid_file):
    prompts = [[3 + i, 50 + 7 * i, 100 + i, 200 - i, 17][: 1 + i] for i in range(5)]  # one a 1-token prompt
    assert_graph_replay_is_eager(hybrid_file, prompts)


@pytest.mark.gpu
def test_a_request_after_an_aborted_one_and_forks_give_a_fresh_engines_tokens(gpu, hybrid_file):
    from infero import LLM, SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = LLM(hybrid_file, device="cuda").generate([PROMPT[:40]], greedy)[0].completion_ids
    llm = LLM(hybrid_file, device="cuda")
    engine = llm.engine
    engine.add_request("gone", PROMPT[50:90], greedy)
    for _ in range(4):  # prefilled and a few tokens decoded: its slot holds a live state
        engine.step()
    engine.abort("gone")
    assert llm.generate([PROMPT[:40]], greedy)[0].completion_ids == want
    forks = llm.generate([PROMPT[:40]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, n=3))
    assert [c.completion_ids for c in forks] == [want] * 3
    stats = engine.stats()
    assert stats.state_slots_used == 0 and stats.kv_blocks_referenced == 0
