"""Logits against transformers (CPU torch, float32), from fixtures made by scripts/make_logit_fixtures.py."""

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from helpers import relative_error

from infero.backends.cpu import CpuBackend
from infero.checkpoint import load_checkpoint
from infero.default_model import default_model_path
from infero.engine.batch import SequenceStep, build_batch
from infero.models import load_model

FIXTURES = Path(__file__).parent.parent / "fixtures" / "models"
TINY = ["tiny-llama-gqa", "tiny-llama-gqa-f16", "tiny-llama-tied", "tiny-llama-rope-freqs", "tiny-qwen2", "tiny-qwen3"]


def fixture(name: str):
    z = np.load(FIXTURES / f"{name}.logits.npz")
    return z, json.loads(str(z["meta"]))


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def teacher_forced_logits(path: Path, prompts: list[np.ndarray]) -> list[np.ndarray]:
    backend = CpuBackend()
    model = load_model(load_checkpoint(path), backend.ops)
    out = []
    for ids in prompts:
        blocks = -(-len(ids) // 16)
        cache = backend.allocate_kv_cache(model.config, blocks, 16)
        batch = build_batch([SequenceStep([int(i) for i in ids], 0, list(range(blocks)), "all")], 16)
        out.append(backend.forward(model, batch, cache))
    return out


@pytest.mark.parametrize("name", TINY)
def test_tiny_model_logits_match_transformers(name):
    z, meta = fixture(name)
    path = FIXTURES / f"{name}.gguf"
    assert sha256(path) == meta["gguf_sha256"], "fixture was made from another file: rerun the fixture scripts"
    prompts = [z[f"ids_{i}"] for i in range(meta["n_prompts"])]
    for i, logits in enumerate(teacher_forced_logits(path, prompts)):
        ref = z[f"logits_{i}"]
        assert relative_error(logits, ref) < 1e-5, name
        assert (logits.argmax(-1) == ref.argmax(-1)).all(), name


def test_smollm2_logits_match_transformers():
    z, meta = fixture("smollm2-135m-instruct-q4_1")
    path = default_model_path()
    assert sha256(path) == meta["gguf_sha256"]
    prompts = [z[f"ids_{i}"] for i in range(meta["n_prompts"])]
    agree = total = 0
    for i, logits in enumerate(teacher_forced_logits(path, prompts)):
        subset = logits[:, z["subset_ids"]]
        assert relative_error(subset, z[f"subset_logits_{i}"]) < 1e-4
        top20 = np.take_along_axis(logits, z[f"top20_ids_{i}"].astype(np.int64), axis=1)
        assert relative_error(top20, z[f"top20_logits_{i}"]) < 1e-4
        np.testing.assert_allclose(np.linalg.norm(logits, axis=1), z[f"row_norm_{i}"], rtol=1e-4)
        agree += int((logits.argmax(-1) == z[f"top1_{i}"]).sum())
        total += len(logits)
    assert agree / total >= 0.999
