"""Every supported tensor type loads and runs through a tiny model, matching a plain float64 reference."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from helpers import relative_error
from reference_forward import reference_logits
from tiny_gguf import ALL_TYPES, TinyShape, write_tiny_model

from infero.backends.cpu import CpuBackend
from infero.checkpoint import load_checkpoint
from infero.engine.batch import SequenceStep, build_batch
from infero.models import load_model

PROMPT = [1, 40, 75, 3, 200, 17, 99, 150, 42, 7, 260, 5]


def run_infero(path, ids):
    backend = CpuBackend()
    model = load_model(load_checkpoint(path), backend.ops)
    cache = backend.allocate_kv_cache(model.config, 4, 16)
    return backend.forward(model, build_batch([SequenceStep(ids, 0, [2, 0], "all")], 16), cache)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda q: q.name)
def test_tensor_type_runs_and_matches_reference(tmp_path, qtype):
    path = write_tiny_model(tmp_path / f"tiny-{qtype.name}.gguf", qtype, seed=int(qtype))
    logits = run_infero(path, PROMPT)
    ref = reference_logits(path, PROMPT)
    assert np.isfinite(logits).all()
    assert relative_error(logits, ref) < 1e-5
    assert (logits.argmax(-1) == ref.argmax(-1)).all()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_architectures_match_reference(tmp_path, arch):
    path = write_tiny_model(tmp_path / f"{arch}.gguf", Q.Q8_0, TinyShape(arch=arch, tied=arch == "qwen3"), seed=3)
    logits = run_infero(path, PROMPT)
    assert relative_error(logits, reference_logits(path, PROMPT)) < 1e-5


def test_split_model_loads_as_one(tmp_path):
    first = write_tiny_model(tmp_path / "split.gguf", Q.Q4_K, split_max_tensors=8, seed=5)
    assert first.name == "split-00001-of-00003.gguf"
    whole = write_tiny_model(tmp_path / "whole.gguf", Q.Q4_K, seed=5)
    assert set(load_checkpoint(first).tensors) == set(load_checkpoint(whole).tensors)
    np.testing.assert_array_equal(run_infero(first, PROMPT), run_infero(whole, PROMPT))
