"""The Qwen3.5 hybrid decoder on the CPU backend (synthetic tiny models, and the Qwen3-Next fixture for its fused
beta/alpha projection and grouped value heads): a prompt gives the same bits however it is
chunked, a sequence the same bits whatever shares its step, and its recurrent state lives in its slot alone."""

from pathlib import Path

import numpy as np
import pytest

from infero.backends.cpu import CpuBackend
from infero.checkpoint import load_checkpoint
from infero.checkpoint.synthetic import write_synthetic
from infero.engine.batch import SequenceStep, build_batch
from infero.models import load_model

BLOCK = 16
VOCAB = 300  # the smallest of the models' vocabularies
PROMPT = [int(t) for t in np.random.default_rng(5).integers(3, VOCAB, size=150)]
FIXTURES = Path(__file__).parent.parent / "fixtures" / "models"


@pytest.fixture(scope="module", params=["qwen35-tiny", "qwen35moe-tiny", "qwen3next-tiny", "tiny-qwen3next"])
def hybrid(request, tmp_path_factory):
    if request.param.startswith("tiny-"):
        path = FIXTURES / f"{request.param}.gguf"
    else:
        path = write_synthetic(request.param, "Q8_0", tmp_path_factory.mktemp("hybrid") / "hybrid.gguf", seed=3)
    backend = CpuBackend()
    return load_model(load_checkpoint(path), backend.ops), backend


def blocks(first: int, tokens: int) -> list[int]:
    return list(range(first, first + -(-tokens // BLOCK)))


def prefill(model, backend, cache, prompt, chunk, slot=0, first_block=0):
    """All logits of the prompt, run `chunk` tokens a step."""
    table, rows = blocks(first_block, len(prompt)), []
    for start in range(0, len(prompt), chunk):
        step = SequenceStep(prompt[start : start + chunk], start, table, "all", state_slot=slot)
        rows.append(backend.forward(model, build_batch([step], BLOCK), cache))
    return np.concatenate(rows)


@pytest.mark.parametrize("chunk", [1, 7, 64, 100])
def test_a_prompt_prefilled_in_chunks_gives_the_bits_of_one_prefill(hybrid, chunk):
    model, backend = hybrid
    whole = prefill(model, backend, backend.allocate_kv_cache(model.config, 10, BLOCK, 1), PROMPT, len(PROMPT))
    chunked = prefill(model, backend, backend.allocate_kv_cache(model.config, 10, BLOCK, 1), PROMPT, chunk)
    assert np.array_equal(chunked, whole)


def test_a_sequence_decoded_alone_gives_the_bits_it_gives_in_a_batch_of_8_mixed_sequences(hybrid):
    model, backend = hybrid
    rng = np.random.default_rng(9)
    prompts = [[int(t) for t in rng.integers(3, VOCAB, size=n)] for n in (20, 33, 5, 17, 40, 9, 26, 12)]
    cache = backend.allocate_kv_cache(model.config, 40, BLOCK, 8)
    # Alone: sequence 0's prompt, then three decode steps of fixed tokens.
    alone = [prefill(model, backend, cache, prompts[0], 64)[-1]]
    for i, token in enumerate((7, 8, 9)):
        step = SequenceStep([token], len(prompts[0]) + i, blocks(0, 64), state_slot=0)
        alone.append(backend.forward(model, build_batch([step], BLOCK), cache)[0])
    # Together: the same, while the others prefill in chunks of 11 or decode, each in its own slot and blocks.
    cache = backend.allocate_kv_cache(model.config, 40, BLOCK, 8)
    done = [0] * 8
    together = []
    for step_index in range(4):
        steps = []
        for s, prompt in enumerate(prompts):
            table = blocks(5 * s, 64)
            if s == 0:
                ids = prompt if step_index == 0 else [(7, 8, 9)[step_index - 1]]
            elif done[s] < len(prompt):
                ids = prompt[done[s] : done[s] + 11]
            else:
                ids = [100 + s]
            steps.append(SequenceStep(ids, done[s], table, "last", state_slot=7 - s))
            done[s] += len(ids)
        together.append(backend.forward(model, build_batch(steps, BLOCK), cache)[0])
    assert np.array_equal(np.stack(together), np.stack(alone))


def test_a_slot_reused_from_position_0_starts_from_a_zero_state(hybrid):
    model, backend = hybrid
    fresh = prefill(model, backend, backend.allocate_kv_cache(model.config, 10, BLOCK, 2), PROMPT[:40], 40)
    cache = backend.allocate_kv_cache(model.config, 10, BLOCK, 2)
    prefill(model, backend, cache, PROMPT[60:100], 40, slot=1)  # leaves its state in slot 1
    assert np.abs(cache.delta[1]).max() > 0 and np.abs(cache.conv[1]).max() > 0
    reused = prefill(model, backend, cache, PROMPT[:40], 40, slot=1, first_block=4)
    assert np.array_equal(reused, fresh)


def test_a_forked_slot_continues_as_the_sequence_it_was_copied_from(hybrid):
    model, backend = hybrid
    cache = backend.allocate_kv_cache(model.config, 10, BLOCK, 2)
    prefill(model, backend, cache, PROMPT[:30], 30, slot=0)
    backend.copy_state(cache, 0, 1)
    backend.copy_blocks(cache, [(0, 4), (1, 5)])
    original = SequenceStep([11], 30, blocks(0, 64), state_slot=0)
    fork = SequenceStep([11], 30, blocks(4, 64), state_slot=1)
    logits = backend.forward(model, build_batch([original, fork], BLOCK), cache)
    assert np.array_equal(logits[0], logits[1])
    assert np.array_equal(cache.delta[0], cache.delta[1]) and np.array_equal(cache.conv[0], cache.conv[1])


def test_the_cache_keeps_kv_for_attention_layers_and_a_state_per_slot(hybrid):
    model, backend = hybrid
    c = model.config
    cache = backend.allocate_kv_cache(c, 3, BLOCK, 5)
    assert len(cache.k) == 1  # one attention layer of 4
    d_k = c.ssm_state_size  # 16, or 64 (qwen3next-tiny)
    assert cache.conv.shape == (5, 3, 2 * 2 * d_k + 4 * 32, 3)
    assert cache.delta.shape == (5, 3, 4, d_k, 32)
    assert backend.state_bytes_per_slot(c) == (cache.conv.nbytes + cache.delta.nbytes) // 5
    assert backend.kv_block_bytes(c, BLOCK) == (cache.k[0].nbytes + cache.v[0].nbytes) // 3
