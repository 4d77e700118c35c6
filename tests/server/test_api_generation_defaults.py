"""A request that leaves a sampling parameter out gets the model's default for it (`--generation-config`)."""

import pytest
from live_server import TEST_DEVICE, TINY_ENGINE, start_server
from tiny_gguf import write_tiny_model

from infero.llm import LLM
from infero.server.app import ServerSettings

FILE = dict(temp=0.7, top_k=5, top_p=0.9, min_p=0.05, penalty_repeat=1.3)  # general.sampling.*
AS_REQUEST = dict(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, repetition_penalty=1.3)
INFERO_OWN = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("defaults") / "m.gguf", sampling=FILE)


@pytest.fixture(scope="module")
def servers(model_path):
    """The model served with its file's defaults, and with none (vLLM's `--generation-config vllm`) but a cap."""

    def load(**kwargs):
        return lambda: LLM(model_path, device=TEST_DEVICE, engine_config=TINY_ENGINE, **kwargs)

    auto = start_server(load(), ServerSettings("m"))
    vllm = start_server(load(generation_config="vllm", override_generation_config={"max_new_tokens": 3}),
                        ServerSettings("m"))  # fmt: skip
    yield auto, vllm
    auto.stop()
    vllm.stop()


def complete(server, **fields) -> dict:
    body = {"model": "m", "prompt": "hello world the", "seed": 11, "ignore_eos": True, **fields}
    r = server.http().post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def chat(server, **fields) -> str:
    body = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "seed": 5, "ignore_eos": True, **fields}
    r = server.http().post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_a_request_without_sampling_parameters_samples_with_the_files(servers):
    auto, _ = servers
    left_out = complete(auto, max_tokens=24)["choices"][0]["text"]
    assert left_out == complete(auto, max_tokens=24, **AS_REQUEST)["choices"][0]["text"]
    assert left_out != complete(auto, max_tokens=24, **INFERO_OWN)["choices"][0]["text"]
    assert chat(auto, max_tokens=24) == chat(auto, max_tokens=24, **AS_REQUEST)
    # one parameter given: it wins, the others keep the file's
    assert (
        complete(auto, max_tokens=24, temperature=0)["choices"][0]["text"]
        == complete(auto, max_tokens=24, **{**AS_REQUEST, "temperature": 0})["choices"][0]["text"]
    )


def test_generation_config_vllm_ignores_the_files_and_max_new_tokens_caps_every_request(servers):
    _, vllm = servers
    left_out = complete(vllm, max_tokens=3)["choices"][0]["text"]
    assert left_out == complete(vllm, max_tokens=3, **INFERO_OWN)["choices"][0]["text"]
    for fields in ({}, {"max_tokens": 40}):
        out = complete(vllm, **fields)
        assert out["usage"]["completion_tokens"] == 3 and out["choices"][0]["finish_reason"] == "length"
    r = vllm.http().post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "x"}],
                                                        "max_completion_tokens": 50})  # fmt: skip
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 3
