"""`infero bench decode` on the GPU: the step table and the in-graph per-op profile of a tiny model."""

import pytest
from gguf import GGMLQuantizationType as Q
from tiny_gguf import write_tiny_model

from infero import LLM
from infero.bench import decode

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def llm(gpu, tmp_path_factory):
    return LLM(write_tiny_model(tmp_path_factory.mktemp("bench") / "m.gguf", Q.Q4_K, seed=3), device="cuda")


def test_bench_decode_reports_a_step_and_its_roofline(llm):
    r = decode.run(llm, prompt_len=64, decode_tokens=8)
    assert r["decode_tok_s"] > 0 and r["prefill_tok_s"] > 0
    assert r["step_bytes"] > sum(w.nbytes for w in vars(llm.model.layers[0]).values() if w is not None)
    assert 0 < r["roofline_fraction"] < 1.0
    assert r["async_scheduling"] is True and r["engine_decode_tok_s"] > 0  # the engine loop, steps queued ahead


def test_profile_times_every_op_of_a_decode_step_inside_a_graph(llm):
    rows, step_us = decode.profile(llm, prompt_len=64, steps=4)
    calls = {label: n for label, _, n in rows}
    layers = llm.config.num_layers
    assert calls["attention"] == layers
    # q/k/v with their rotation and cache write in one op, gate/up with SwiGLU in one; o and down with the residual
    # add and the norm after them (the last down and the output head through linear, the first and the last norm
    # alone): one call each.
    assert sum(n for label, n in calls.items() if label.startswith("qkv_rotary_store ")) == layers
    assert sum(n for label, n in calls.items() if label.startswith("swiglu_gate_up ")) == layers
    assert sum(n for label, n in calls.items() if label.startswith("linear_add_rms_norm ")) == 2 * layers - 1
    assert sum(n for label, n in calls.items() if label.startswith("linear ")) == 2
    assert calls["add_rms_norm"] == 2
    assert all(us > 0 for _, us, _ in rows)
    # Inside one graph the ops run back to back: their sum is the step's GPU time plus the event nodes' own cost,
    # far below what eager launches through Python would show (tens of microseconds per op).
    total = sum(us for _, us, _ in rows)
    assert 0 < step_us and total < step_us + 5 * sum(calls.values())
    print(decode.format_profile(rows, step_us))


def test_batched_decode_times_steps_of_several_sequences(llm):
    one, four = decode.batched(llm, 1, prompt_len=32, steps=6), decode.batched(llm, 4, prompt_len=32, steps=6)
    assert 0 < one and 0 < four
    table = decode.format_batched([(1, one), (4, four)])
    assert table.splitlines()[2].split()[0] == "4" and float(table.splitlines()[2].split()[-1].replace(",", "")) > 0
    print(table)


def test_profile_of_several_sequences_times_one_step_of_them_all(llm):
    rows, step_us = decode.profile(llm, prompt_len=32, steps=3, batch=4)
    calls = {label: n for label, _, n in rows}
    assert calls["attention"] == llm.config.num_layers and step_us > 0
    assert decode.format_profile(rows, step_us, batch=4).splitlines()[0].startswith("op, 4 sequences")


def test_prefill_profile_times_every_op_of_an_eager_prompt_chunk(llm):
    rows, prefill_us, tokens = decode.profile_prefill(llm, prompt_len=96, repeats=2)
    calls = {label: n for label, _, n in rows}
    assert tokens == 96 and calls["attention"] == llm.config.num_layers and prefill_us > 0
    assert all(us > 0 for _, us, _ in rows)
    assert decode.format_profile(rows, prefill_us, prefill=tokens).splitlines()[0].startswith("op, prefill of 96")


def test_graph_step_timer_captures_the_step_anew_on_every_call(llm):
    """The A/B scripts' timer: each call discards the captured graphs and times a fresh capture of the step."""
    step_us = decode.graph_step_timer(llm, prompt_len=32, steps=3)
    first = step_us()
    graphs = dict(llm.backend._graphs)
    second = step_us()
    assert first > 0 and second > 0 and graphs
    assert set(llm.backend._graphs) == set(graphs)
    assert all(llm.backend._graphs[width] is not graphs[width] for width in graphs)


def test_a_step_larger_than_the_engine_was_sized_for_is_refused_clearly(gpu, tmp_path):
    """One forward of more tokens than max_num_batched_tokens (or more cache blocks than the context holds) would
    overrun the step's buffers on the GPU: it is refused with an error naming the limit, and the backend keeps
    working; the benchmarks run such a prompt in chunks."""
    import numpy as np

    from infero.engine.batch import SequenceStep, build_batch
    from infero.engine.engine import EngineConfig
    from infero.errors import InferoError

    path = write_tiny_model(tmp_path / "m.gguf", Q.Q4_K, seed=3)
    llm = LLM(path, device="cuda", engine_config=EngineConfig(max_num_batched_tokens=32))
    ids = np.random.default_rng(2).integers(0, llm.config.vocab_size, size=100).tolist()
    cache = llm.backend.allocate_kv_cache(llm.config, 8, decode.BLOCK_SIZE)
    with pytest.raises(InferoError, match="max_num_batched_tokens"):
        llm.backend.forward(llm.model, build_batch([SequenceStep(ids, 0, list(range(8)))], decode.BLOCK_SIZE), cache)
    with pytest.raises(InferoError, match="blocks"):
        llm.backend.forward(llm.model, build_batch([SequenceStep(ids[:1], 0, list(range(400)))], 16), cache)
    r = decode.run(llm, prompt_len=100, decode_tokens=4)  # chunks of 32
    assert r["prefill_tokens"] == 100 and r["decode_tok_s"] > 0
