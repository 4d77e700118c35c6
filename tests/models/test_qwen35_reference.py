"""Tiny Qwen3.5, Qwen3.5-MoE and Qwen3-Next hybrids against transformers, from fixtures made by
scripts/make_qwen35_fixtures.py (llama.cpp's converter wrote the GGUFs from the transformers models the logits came
from; 2 key heads serve 4 value heads, so the V-head order of each file matters)."""

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
from infero.engine.engine import EngineConfig
from infero.models import load_model

FIXTURES = Path(__file__).parent.parent / "fixtures" / "models"
# tiny-qwen35-mtp: tiny-qwen35 converted with a multi-token-prediction block (a fifth layer the text model skips)
MODELS = ["tiny-qwen35", "tiny-qwen35moe", "tiny-qwen3next", "tiny-qwen35-mtp"]


def fixture(name: str):
    z = np.load(FIXTURES / f"{name}.logits.npz")
    meta = json.loads(str(z["meta"]))
    path = FIXTURES / f"{name}.gguf"
    assert hashlib.sha256(path.read_bytes()).hexdigest() == meta["gguf_sha256"], "rerun make_qwen35_fixtures.py"
    return path, z, meta


@pytest.mark.parametrize("name", MODELS)
def test_teacher_forced_logits_match_transformers(name):
    path, z, meta = fixture(name)
    backend = CpuBackend()
    model = load_model(load_checkpoint(path), backend.ops)
    for i in range(meta["n_prompts"]):
        ids = [int(t) for t in z[f"ids_{i}"]]
        blocks = -(-len(ids) // 16)
        cache = backend.allocate_kv_cache(model.config, blocks, 16, num_state_slots=1)
        step = SequenceStep(ids, 0, list(range(blocks)), "all", state_slot=0)
        logits = backend.forward(model, build_batch([step], 16), cache)
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


@pytest.mark.parametrize("name", MODELS)
def test_the_longest_prompt_chunked_by_the_engine_matches_transformers(name):
    """The 70-token prompt prefilled 7 tokens a step by the scheduler: the state carried across steps."""
    path, z, meta = fixture(name)
    i = meta["n_prompts"] - 1
    llm = LLM(path, device="cpu", engine_config=EngineConfig(max_num_batched_tokens=7))
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    ids = [int(t) for t in z[f"ids_{i}"]]
    [out] = llm.generate([ids], params)
    assert out.completion_ids[0] == int(z[f"logits_{i}"][-1].argmax())


@pytest.mark.parametrize("name, sections, shared", [("tiny-qwen35", (2, 1, 1, 0), 0),
                                                    ("tiny-qwen35moe", (2, 1, 1, 0), 32),
                                                    ("tiny-qwen3next", (), 32)])  # fmt: skip
def test_the_fixtures_hyperparameters_read_as_the_converter_wrote_them(name, sections, shared):
    """The values make_qwen35_fixtures.py's configs give the converter (2 key heads of 16, 4 value heads of 32)."""
    c = load_checkpoint(FIXTURES / f"{name}.gguf").config
    assert c.recurrent_layers == (True, True, True, False) and c.num_recurrent_layers == 3 and c.is_hybrid
    assert (c.ssm_conv_kernel, c.ssm_state_size, c.ssm_group_count, c.ssm_time_step_rank) == (4, 16, 2, 4)
    assert (c.ssm_inner_size, c.linear_v_dim, c.conv_channels) == (128, 32, 192)
    assert (c.head_dim, c.rope_dim, c.rope_pairing, c.rope_sections) == (32, 8, "neox", sections)
    assert c.shared_expert_intermediate_size == shared
