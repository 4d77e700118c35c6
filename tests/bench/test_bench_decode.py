"""`infero bench decode --batch` on the CPU backend: steps of several sequences, and batch sizes the engine cannot
step are refused with a clear error."""

import tempfile
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as Q
from tiny_gguf import write_tiny_model

from infero import LLM
from infero.bench import decode
from infero.errors import InferoError


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    return LLM(write_tiny_model(tmp_path_factory.mktemp("bench") / "m.gguf", Q.Q8_0, seed=5), device="cpu")


def test_batched_decode_steps_several_sequences(llm):
    seconds = decode.batched(llm, 3, prompt_len=8, steps=4)
    assert seconds > 0
    line = decode.format_batched([(3, seconds)]).splitlines()[1].split()
    assert line[0] == "3" and float(line[-1].replace(",", "")) == pytest.approx(3 / seconds, rel=1e-3)


@pytest.mark.parametrize("batch", [0, 10_000])
def test_batch_sizes_the_engine_cannot_step_are_refused(llm, batch):
    with pytest.raises(InferoError, match="--max-num-seqs"):
        decode.batched(llm, batch, prompt_len=8, steps=2)


def test_the_table_reports_the_engine_loop_beside_the_single_step(llm):
    r = decode.run(llm, prompt_len=8, decode_tokens=6)
    assert r["engine_decode_tok_s"] == pytest.approx(1e3 / r["engine_ms"]) and r["async_scheduling"] is False
    table = decode.format_table("tiny", "cpu", r)
    assert "decode, engine loop" in table and "asynchronous scheduling off" in table


def test_a_prompt_longer_than_a_step_is_prefilled_in_chunks(tmp_path):
    """The benchmarks run a prompt past max_num_batched_tokens in chunks, as the engine does (one forward of it
    overran the GPU backend's step buffers): the chunks leave the cache as one forward of the whole prompt does."""
    import numpy as np

    from infero.engine.batch import SequenceStep, build_batch
    from infero.engine.engine import EngineConfig

    path = write_tiny_model(tmp_path / "m.gguf", Q.Q8_0, seed=5)
    llm = LLM(path, device="cpu", engine_config=EngineConfig(max_num_batched_tokens=16))
    ids = np.random.default_rng(1).integers(0, llm.config.vocab_size, size=41).tolist()
    table = list(range(4))
    caches = [llm.backend.allocate_kv_cache(llm.config, 4, decode.BLOCK_SIZE) for _ in range(2)]
    last = decode.prefill_chunks(llm, caches[0], table, ids[:-1])
    assert last == 32  # chunks at 0 and 16 run by prefill_chunks, the caller's from 32
    forward = llm.backend.forward
    forward(llm.model, build_batch([SequenceStep(ids[last:-1], last, table, "none")], decode.BLOCK_SIZE), caches[0])
    forward(llm.model, build_batch([SequenceStep(ids[:-1], 0, table, "none")], decode.BLOCK_SIZE), caches[1])
    step = build_batch([SequenceStep(ids[-1:], 40, table)], decode.BLOCK_SIZE)
    chunked, whole = (np.asarray(forward(llm.model, step, cache)) for cache in caches)
    np.testing.assert_allclose(chunked, whole, rtol=1e-5, atol=1e-5)
    assert decode.run(llm, prompt_len=40, decode_tokens=4)["prefill_tokens"] == 40


def test_a_hybrid_model_is_benchmarked_with_a_state_slot_per_sequence():
    path = Path(__file__).parent.parent / "fixtures" / "models" / "tiny-qwen35.gguf"
    hybrid = LLM(path, device="cpu")
    r = decode.run(hybrid, prompt_len=40, decode_tokens=4)  # 40 tokens: prefilled in chunks of 16, one slot
    assert r["prefill_tokens"] == 40 and r["decode_tok_s"] > 0
    assert r["step_bytes"] > 2 * hybrid.backend.state_bytes_per_slot(hybrid.config)  # the state read and written
    assert decode.batched(hybrid, 3, prompt_len=20, steps=4) > 0


def test_a_moe_step_counts_the_chosen_experts_bytes_not_all_of_them(tmp_path):
    """A token reads k of a layer's E experts: the step's bytes are the dense weights plus k / E of the expert
    tensors (2 of 8 here), counted from the model's own arrays."""
    from tiny_moe import write_tiny_moe

    llm = LLM(write_tiny_moe(tmp_path / "moe.gguf", experts=8, used=2), device="cpu")
    from dataclasses import replace
    from types import SimpleNamespace

    model = llm.model
    experts = sum(getattr(layer, f).nbytes for layer in model.layers for f in decode.EXPERT_TENSORS)
    chosen = decode.decode_step_bytes(model, llm.backend, 32)
    every = SimpleNamespace(**{k: getattr(model, k) for k in ("layers", "output", "output_norm", "embedding")},
                            config=replace(model.config, num_experts_used=8))  # fmt: skip
    assert chosen == decode.decode_step_bytes(every, llm.backend, 32) - experts + experts // 4


def test_a_folded_shared_expert_counts_as_one_more_expert_every_token_reads():
    """qwen35moe-tiny's shared expert is as wide as its experts, so it loads as expert 8 of 9: a token reads k + 1 of
    the 9 (the shared one always), which the step's bytes count as (2 + 1) / (8 + 1) of the expert tensors."""
    from infero.checkpoint.synthetic import write_synthetic

    path = write_synthetic("qwen35moe-tiny", "Q8_0", Path(tempfile.mkdtemp()) / "moe.gguf", seed=2)
    llm = LLM(path, device="cpu")
    ffn = llm.model.layers[0].ffn
    assert "shexp_gate" not in ffn and ffn["gate_exps"].shape[0] == 9
    assert decode._active_experts(llm.config, llm.model.layers[0]) == 3 / 9
