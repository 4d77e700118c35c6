"""The model's sampling defaults: from the GGUF file's general.sampling.*, a generation_config.json, an override."""

import json

import pytest
from tiny_gguf import write_tiny_model

from infero.checkpoint import load_checkpoint
from infero.engine import generation_defaults as gd
from infero.engine.generation_defaults import GenerationConfigError
from infero.engine.sampling import SamplingParams

QWEN3 = dict(temp=0.6, top_k=20, top_p=0.95, min_p=0.0)  # Qwen3's generation_config.json, as the converter writes it


@pytest.fixture(scope="module")
def qwen3_like(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("sampling") / "m.gguf", sampling=QWEN3)


def test_auto_reads_what_the_converter_wrote_as_the_decimals_it_was_written_from(qwen3_like):
    metadata = load_checkpoint(qwen3_like).metadata
    assert metadata["general.sampling.top_p"] != 0.95  # stored as float32: 0.949999988...
    defaults, notes = gd.resolve("auto", metadata)
    assert defaults == {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "min_p": 0.0} and notes == []


def test_vllm_takes_none_of_the_files_and_an_override_is_laid_over_either(qwen3_like):
    metadata = load_checkpoint(qwen3_like).metadata
    assert gd.resolve("vllm", metadata) == ({}, [])
    assert gd.resolve("vllm", metadata, {"temperature": 0.2})[0] == {"temperature": 0.2}
    defaults, _ = gd.resolve("auto", metadata, {"temperature": 0.2, "max_new_tokens": 64})
    assert defaults == {"temperature": 0.2, "top_k": 20, "top_p": 0.95, "min_p": 0.0, "max_new_tokens": 64}


def test_a_value_the_sampler_would_refuse_is_left_out_with_a_note():
    metadata = {"general.sampling.temp": -1.0, "general.sampling.top_k": 40, "general.sampling.top_p": 1.5}
    defaults, notes = gd.resolve("auto", metadata)
    assert defaults == {"top_k": 40}
    assert len(notes) == 2 and "general.sampling.temp" in notes[0] and "temperature" in notes[0]
    assert "general.sampling.top_p" in notes[1] and "not used" in notes[1]


def test_a_generation_config_json_or_its_folder(tmp_path):
    config = {"bos_token_id": 1, "do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20,
              "repetition_penalty": 1.05, "max_new_tokens": 2048, "transformers_version": "4.51.0"}  # fmt: skip
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    expected = {"temperature": 0.7, "top_k": 20, "top_p": 0.8, "repetition_penalty": 1.05, "max_new_tokens": 2048}
    assert gd.resolve(str(tmp_path), {})[0] == expected
    assert gd.resolve(str(tmp_path / "generation_config.json"), {"general.sampling.temp": 0.1})[0] == expected


@pytest.mark.parametrize(
    "content, message",
    [(None, "cannot read"), ("{", "is not JSON"), ("[1]", "no JSON object"), ('{"temperature": -2}', "temperature"),
     ('{"top_k": "many"}', "top_k")],
)  # fmt: skip
def test_a_generation_config_that_cannot_serve_is_refused_naming_it(tmp_path, content, message):
    file = tmp_path / "generation_config.json"
    if content is not None:
        file.write_text(content)
    with pytest.raises(GenerationConfigError, match=message) as info:
        gd.resolve(str(file), {})
    assert "--generation-config" in str(info.value)


@pytest.mark.parametrize(
    "override, message",
    [({"seed": 3}, "seed cannot be set there"), ({"top_p": 0}, "top_p"), ({"max_new_tokens": 0}, "max_tokens"),
     ({"temperature": [1]}, "temperature must be a number")],
)  # fmt: skip
def test_an_override_the_sampler_would_refuse_is_an_error(override, message):
    with pytest.raises(GenerationConfigError, match=message) as info:
        gd.resolve("vllm", {}, override)
    assert "--override-generation-config" in str(info.value)


def test_a_given_value_wins_and_max_new_tokens_caps_max_tokens():
    defaults = {"temperature": 0.6, "top_k": 20, "max_new_tokens": 32}
    assert gd.sampling_params(defaults) == SamplingParams(temperature=0.6, top_k=20, max_tokens=32)
    assert gd.sampling_params(defaults, temperature=0.0, top_k=None, max_tokens=100) == SamplingParams(
        temperature=0.0, top_k=20, max_tokens=32
    )
    assert gd.sampling_params(defaults, max_tokens=8).max_tokens == 8
    assert gd.sampling_params({}) == SamplingParams()
