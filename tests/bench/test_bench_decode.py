"""`infero bench decode --batch` on the CPU backend: steps of several sequences, and batch sizes the engine cannot
step are refused with a clear error."""

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
