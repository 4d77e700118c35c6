"""Tiny Qwen3-MoE models against transformers, from fixtures made by scripts/make_moe_fixtures.py (llama.cpp's
converter wrote the GGUFs from the transformers models the logits came from)."""

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from helpers import relative_error

from infero import LLM, SamplingParams
from infero.backends.cpu import CpuBackend
from infero.checkpoint import load_checkpoint
from infero.engine.batch import SequenceStep, build_batch
from infero.models import load_model

FIXTURES = Path(__file__).parent.parent / "fixtures" / "models"
MODELS = ["tiny-qwen3moe", "tiny-qwen3moe-k1", "tiny-qwen3moe-k8", "tiny-qwen3moe-skewed"]


def fixture(name: str):
    z = np.load(FIXTURES / f"{name}.logits.npz")
    meta = json.loads(str(z["meta"]))
    path = FIXTURES / f"{name}.gguf"
    assert hashlib.sha256(path.read_bytes()).hexdigest() == meta["gguf_sha256"], "rerun make_moe_fixtures.py"
    return path, z, meta


@pytest.mark.parametrize("name", MODELS)
def test_teacher_forced_logits_match_transformers(name):
    path, z, meta = fixture(name)
    backend = CpuBackend()
    model = load_model(load_checkpoint(path), backend.ops)
    for i in range(meta["n_prompts"]):
        ids = [int(t) for t in z[f"ids_{i}"]]
        blocks = -(-len(ids) // 16)
        cache = backend.allocate_kv_cache(model.config, blocks, 16)
        logits = backend.forward(model, build_batch([SequenceStep(ids, 0, list(range(blocks)), "all")], 16), cache)
        ref = z[f"logits_{i}"]
        assert relative_error(logits, ref) < 1e-4, name
        assert (logits.argmax(-1) == ref.argmax(-1)).all(), name


@pytest.mark.parametrize("name", MODELS)
def test_greedy_continuations_match_transformers(name):
    path, z, meta = fixture(name)
    llm = LLM(path, device="cpu")
    for i in meta["greedy_prompts"]:
        want = z[f"greedy_{i}"].tolist()
        params = SamplingParams(temperature=0, max_tokens=len(want), ignore_eos=True)
        [out] = llm.generate([[int(t) for t in z[f"ids_{i}"]]], params)
        assert out.completion_ids == want, name


def test_the_skewed_model_routes_every_token_to_expert_0_and_none_to_experts_6_and_7():
    _, z, meta = fixture("tiny-qwen3moe-skewed")
    tokens = sum(len(z[f"ids_{i}"]) for i in range(meta["n_prompts"]))
    for per_expert in meta["tokens_per_expert"]:
        assert per_expert[0] == tokens and per_expert[6:] == [0, 0]
