"""Hybrid (Qwen3.5) files: a missing delta-net tensor or wrong layer kinds is one `infero: error:` line, exit status
2; a file that carries its multi-token-prediction block runs as the text model without it."""

import copy

import gguf_fields
import pytest
from gguf_fields import ARRAY, BOOL, UINT32, Value

from infero import LLM, SamplingParams
from infero.checkpoint.synthetic import write_synthetic
from infero.cli import main
from infero.errors import ModelFileError


@pytest.fixture(scope="module")
def hybrid_fields(tmp_path_factory):
    """The fields of a 4-layer qwen35 file: layers 0-2 Gated DeltaNet, layer 3 gated attention."""
    return gguf_fields.parse(write_synthetic("qwen35-tiny", "Q8_0", tmp_path_factory.mktemp("h") / "h.gguf"))


def edited(fields, path, metadata=None, drop=()):
    f = copy.copy(fields)
    f.metadata = {**f.metadata, **(metadata or {})}
    f.tensors = [t for t in f.tensors if t.name not in drop]
    return gguf_fields.write(f, path)


def kinds(*recurrent: bool) -> Value:
    return Value(ARRAY, list(recurrent), BOOL)


def assert_one_line_error(capsys, path, needle):
    code = main(["generate", "--model", str(path), "--device", "cpu", "--max-tokens", "2", "hello"])
    err = capsys.readouterr().err
    assert code == 2
    errors = [line for line in err.strip().splitlines() if line.startswith("infero: error:")]
    assert len(errors) == 1 and err.strip().endswith(errors[0]) and needle in errors[0], err
    assert "Traceback" not in err


@pytest.mark.parametrize("name", ["blk.1.ssm_a", "blk.0.attn_qkv.weight", "blk.2.ssm_conv1d.weight"])
def test_a_missing_delta_net_tensor(capsys, tmp_path, hybrid_fields, name):
    path = edited(hybrid_fields, tmp_path / "h.gguf", drop=(name,))
    assert_one_line_error(capsys, path, f"missing tensor {name!r}")


@pytest.mark.parametrize("recurrent", [(True, True, True), (True, True, True, False, True)])
def test_recurrent_layers_of_the_wrong_length(capsys, tmp_path, hybrid_fields, recurrent):
    path = edited(hybrid_fields, tmp_path / "h.gguf", {"qwen35.attention.recurrent_layers": kinds(*recurrent)})
    assert_one_line_error(capsys, path, f"recurrent_layers has {len(recurrent)} entries")


@pytest.mark.parametrize("recurrent, layer", [((False, True, True, False), 0), ((True, False, True, False), 1)])
def test_recurrent_layers_that_call_a_delta_net_layer_attention(capsys, tmp_path, hybrid_fields, recurrent, layer):
    path = edited(hybrid_fields, tmp_path / "h.gguf", {"qwen35.attention.recurrent_layers": kinds(*recurrent)})
    assert_one_line_error(capsys, path, f"recurrent_layers makes layer {layer} an attention layer")


def test_recurrent_layers_that_call_an_attention_layer_a_delta_net(capsys, tmp_path, hybrid_fields):
    f = copy.copy(hybrid_fields)
    swap = {"blk.0.": "blk.3.", "blk.3.": "blk.0."}  # the attention layer first, the metadata unchanged
    f.tensors = [copy.copy(t) for t in f.tensors]
    for t in f.tensors:
        if t.name[:6] in swap:
            t.name = swap[t.name[:6]] + t.name[6:]
    path = gguf_fields.write(f, tmp_path / "h.gguf")
    assert_one_line_error(capsys, path, "recurrent_layers makes layer 0 a Gated DeltaNet layer")


def test_a_hybrid_without_attention_layers_is_refused(capsys, tmp_path, hybrid_fields):
    path = edited(hybrid_fields, tmp_path / "h.gguf", {"qwen35.attention.recurrent_layers": kinds(*[True] * 4)})
    assert_one_line_error(capsys, path, "makes every layer a Gated DeltaNet layer")


def test_value_heads_that_are_not_a_multiple_of_the_key_heads(capsys, tmp_path, hybrid_fields):
    path = edited(hybrid_fields, tmp_path / "h.gguf", {"qwen35.ssm.time_step_rank": Value(UINT32, 3)})
    assert_one_line_error(capsys, path, "qwen35.ssm.time_step_rank = 3 is invalid")


def test_a_file_with_its_prediction_block_runs_as_the_text_model_alone(tmp_path, hybrid_fields):
    """The converter writes Qwen3.5's MTP block as one more layer (block_count + 1, nextn_predict_layers 1)."""
    plain = edited(hybrid_fields, tmp_path / "plain.gguf")
    f = copy.copy(hybrid_fields)
    extra = [copy.copy(t) for t in f.tensors if t.name.startswith("blk.3.")]
    for t in extra:
        t.name = "blk.4." + t.name[len("blk.3.") :]
    f.tensors = f.tensors + extra
    f.metadata = {**f.metadata, "qwen35.block_count": Value(UINT32, 5), "qwen35.nextn_predict_layers": Value(UINT32, 1),
                  "qwen35.attention.recurrent_layers": kinds(True, True, True, False, False)}  # fmt: skip
    with_mtp = gguf_fields.write(f, tmp_path / "mtp.gguf")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    [want] = LLM(plain, device="cpu").generate([[1, 5, 9, 200]], params)
    llm = LLM(with_mtp, device="cpu")
    [got] = llm.generate([[1, 5, 9, 200]], params)
    assert llm.config.num_layers == 4 and got.completion_ids == want.completion_ids


def test_a_file_without_recurrent_layers_takes_the_layer_kinds_from_the_interval(tmp_path, hybrid_fields):
    f = copy.copy(hybrid_fields)
    f.metadata = {k: v for k, v in f.metadata.items() if k != "qwen35.attention.recurrent_layers"}
    assert f.metadata["qwen35.full_attention_interval"].value == 4
    llm = LLM(gguf_fields.write(f, tmp_path / "interval.gguf"), device="cpu")
    assert llm.config.recurrent_layers == (True, True, True, False)
    f.metadata["qwen35.full_attention_interval"] = Value(UINT32, 2)  # layers 1 and 3 attention: not this file's
    with pytest.raises(ModelFileError, match="makes layer 1 an attention layer"):
        LLM(gguf_fields.write(f, tmp_path / "interval2.gguf"), device="cpu")
