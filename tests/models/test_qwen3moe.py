"""The qwen3moe decoder on the CPU backend: every dense tensor type in the expert tensors, and a sequence's logits
independent of what shares its step."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from helpers import relative_error
from reference_forward import reference_logits
from tiny_moe import write_tiny_moe

from infero.backends.cpu import CpuBackend
from infero.checkpoint import load_checkpoint
from infero.engine.batch import SequenceStep, build_batch
from infero.models import load_model

PROMPT = [1, 40, 75, 3, 200, 17, 99, 150, 42, 7, 260, 5]


def load(path):
    backend = CpuBackend()
    return load_model(load_checkpoint(path), backend.ops), backend


def run(model, backend, steps: list[SequenceStep], num_blocks: int = 4):
    cache = backend.allocate_kv_cache(model.config, num_blocks, 16)
    return backend.forward(model, build_batch(steps, 16), cache), cache


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.IQ4_NL])
def test_expert_tensors_of_every_32_wide_type_match_a_float64_reference(tmp_path, qtype):
    path = write_tiny_moe(tmp_path / "moe.gguf", qtype=qtype)
    model, backend = load(path)
    logits, _ = run(model, backend, [SequenceStep(PROMPT, 0, [0], "all")])
    ref = reference_logits(path, PROMPT)
    assert relative_error(logits, ref) < 1e-5
    assert (logits.argmax(-1) == ref.argmax(-1)).all()


@pytest.mark.parametrize("experts, used", [(8, 1), (8, 8), (4, 3)])
def test_any_number_of_active_experts_matches_a_float64_reference(tmp_path, experts, used):
    path = write_tiny_moe(tmp_path / "moe.gguf", experts=experts, used=used)
    model, backend = load(path)
    logits, _ = run(model, backend, [SequenceStep(PROMPT, 0, [0], "all")])
    assert relative_error(logits, reference_logits(path, PROMPT)) < 1e-5


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return load(write_tiny_moe(tmp_path_factory.mktemp("moe") / "moe.gguf", seed=4))


def test_a_sequences_logits_do_not_depend_on_the_sequences_beside_it(moe):
    model, backend = moe
    alone, _ = run(model, backend, [SequenceStep(PROMPT, 0, [0], "all")])
    other = [9, 8, 7, 6, 5, 4, 3, 2, 1, 100, 101]
    together, _ = run(model, backend, [SequenceStep(other, 0, [1], "all"), SequenceStep(PROMPT, 0, [0], "all")])
    assert np.array_equal(together[len(other) :], alone)


def test_a_prompt_prefilled_in_chunks_gives_the_logits_of_one_prefill(moe):
    model, backend = moe
    whole, _ = run(model, backend, [SequenceStep(PROMPT, 0, [0], "all")])
    cache = backend.allocate_kv_cache(model.config, 4, 16)
    first = backend.forward(model, build_batch([SequenceStep(PROMPT[:5], 0, [0], "all")], 16), cache)
    rest = backend.forward(model, build_batch([SequenceStep(PROMPT[5:], 5, [0], "all")], 16), cache)
    chunked = np.concatenate([first, rest])
    assert np.array_equal(chunked, whole)
