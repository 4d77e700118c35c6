"""Every error status the API gives, in OpenAI's shape: 400, 401, 404, 413, 503 (queue full, loading)."""

import threading
import time

import httpx
import openai
import pytest

from infero.engine.engine import EngineConfig
from infero.errors import ModelFileError

HELLO = [{"role": "user", "content": "hello"}]
CHAT = {"model": "tiny", "messages": HELLO, "max_tokens": 2}


def assert_error(r: httpx.Response, status: int, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if code is not None:
        assert error["code"] == code
    return error


@pytest.mark.parametrize(
    "body, param",
    [
        (b"{not json", None),
        (b"", None),
        (b"[1, 2]", None),
        (b"\xff\xfe{}", None),
        (b'{"model": "tiny", "messages": "hello"}', "messages"),
        (b'{"model": "tiny", "messages": []}', "messages"),
        (b'{"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}', "messages.0.role"),
        (b'{"model": "tiny", "messages": [{"role": "user"}]}', "messages.0"),
        (b'{"model": "tiny", "messages": [{"role": "user", "content": 5}]}', "messages.0.content"),
        (b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}', "temperature"),
        (b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "temperature": -1}', "temperature"),
        (b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "top_p": 0}', "top_p"),
        (b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "n": 0}', "n"),
        (b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1.5}', "max_tokens"),
        (b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "stream": "yes"}', "stream"),
        (b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "stop": [1]}', "stop"),
        (b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}', None),
        (b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "logit_bias": {"a": 1}}', "logit_bias"),
        (b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "logit_bias": {"1": 500}}', "logit_bias"),
        (b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "seed": 1e400}', "seed"),
        (b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "stop_token_ids": [99999]}',
         "stop_token_ids"),
        (b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "n": 100000}', "n"),
        (b'{"model": 7, "messages": [{"role": "user", "content": "x"}]}', "model"),
    ],
)  # fmt: skip
def test_malformed_or_invalid_chat_requests_are_400_naming_the_field(server, body, param):
    r = server.http().post("/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
    error = assert_error(r, 400)
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param


def test_a_prompt_longer_than_the_context_is_context_length_exceeded(server):
    client = server.client()
    long_text = "hello " * 300
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": long_text}])
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt=long_text)
    assert e.value.code == "context_length_exceeded" and e.value.param == "prompt"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt=[1] * 256, max_tokens=1)
    assert e.value.code == "context_length_exceeded"


def test_an_api_key_guards_the_api_but_not_health_and_metrics(fresh_server):
    live = fresh_server(api_key="sekrit")
    with pytest.raises(openai.AuthenticationError):
        live.client(api_key="wrong").chat.completions.create(model="tiny", messages=HELLO, max_tokens=1)
    http = live.http()
    assert_error(http.post("/v1/chat/completions", json=CHAT), 401, "invalid_api_key")
    assert_error(http.get("/v1/models", headers={"Authorization": "Basic sekrit"}), 401)
    assert_error(http.post("/tokenize", json={"prompt": "x"}, headers={"Authorization": "Bearer sekri"}), 401)
    assert http.get("/health").status_code == 200 and http.get("/metrics").status_code == 200
    r = live.client(api_key="sekrit").chat.completions.create(model="tiny", messages=HELLO, max_tokens=1)
    assert r.usage.completion_tokens == 1


def test_unknown_models_and_routes_are_404(server):
    http = server.http()
    assert_error(http.post("/v1/chat/completions", json={**CHAT, "model": "gpt-4o"}), 404, "model_not_found")
    assert_error(http.post("/tokenize", json={"model": "other", "prompt": "x"}), 404, "model_not_found")
    assert_error(http.get("/v1/nothing-here"), 404)
    assert_error(http.get("/v1/chat/completions"), 405)
    with pytest.raises(openai.NotFoundError):
        server.client().chat.completions.create(model="tiny-2", messages=HELLO)


def test_a_body_over_32_mib_is_413_by_length_or_by_counting(server):
    http = server.http()
    big = b'{"model": "tiny", "prompt": "' + b"x" * (32 << 20) + b'"}'
    assert_error(http.post("/v1/completions", content=big), 413, "request_too_large")

    def chunked():  # no Content-Length: the server counts what arrives
        for _ in range(34):
            yield b" " * (1 << 20)

    assert_error(http.post("/v1/completions", content=chunked()), 413, "request_too_large")
    assert http.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 1}).status_code == 200


def test_a_full_waiting_queue_is_503_for_a_request_that_fits_it_later(fresh_server):
    live = fresh_server(EngineConfig(max_num_seqs=1, kv_cache_bytes=16 << 20), step_delay=0.01, max_waiting_requests=1)
    body = {**CHAT, "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=live.url, timeout=30) as http:
        with http.stream("POST", "/v1/chat/completions", json=body) as running:
            lines = running.iter_lines()
            while '"content":""' in next(lines) or live.state.num_queued:
                pass  # until the first request has its first token
            with http.stream("POST", "/v1/chat/completions", json=body) as waiting:
                assert waiting.status_code == 200
                assert_error(http.post("/v1/chat/completions", json=CHAT), 503, "queue_full")
                assert_error(http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}), 503, "queue_full")
    live.wait_idle()
    assert http_ok(live)


def http_ok(live) -> bool:
    return live.http().post("/v1/chat/completions", json=CHAT).status_code == 200


def test_health_is_503_while_the_model_loads_and_200_when_ready(fresh_server, tiny_model_path):
    from live_server import tiny_loader

    release = threading.Event()
    load = tiny_loader(tiny_model_path)

    def slow_load():
        release.wait(30)
        return load()

    live = fresh_server(load=slow_load, wait_ready=False)
    http = live.http()
    assert_error(http.get("/health"), 503, "loading")
    assert_error(http.post("/v1/chat/completions", json=CHAT), 503, "loading")
    assert_error(http.get("/v1/models"), 503, "loading")
    assert http.get("/metrics").status_code == 200
    with pytest.raises(openai.InternalServerError):
        live.client().chat.completions.create(model="tiny", messages=HELLO)
    release.set()
    deadline = time.monotonic() + 30
    while http.get("/health").status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert http_ok(live)


def test_a_model_that_fails_to_load_leaves_health_503(fresh_server):
    def broken():
        raise ModelFileError("not a GGUF file")

    live = fresh_server(load=broken, wait_ready=False)
    deadline = time.monotonic() + 10
    while live.state.status != "failed":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    error = assert_error(live.http().get("/health"), 503, "load_failed")
    assert "not a GGUF file" in error["message"]


def test_stopping_refuses_new_requests_and_lets_running_ones_finish(fresh_server):
    live = fresh_server(step_delay=0.005)
    body = {**CHAT, "max_tokens": 40, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=live.url, timeout=30) as http:
        with http.stream("POST", "/v1/chat/completions", json=body) as running:
            lines = running.iter_lines()
            next(lines)
            live.state.begin_shutdown()
            assert_error(http.post("/v1/chat/completions", json=CHAT), 503, "shutting_down")
            assert_error(http.get("/health"), 503, "shutting_down")
            rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]" and '"finish_reason":"length"' in rest[-2]


def test_an_unexpected_exception_is_a_500_in_the_same_shape_and_the_server_goes_on(server, monkeypatch, caplog):
    def broken(stats):
        raise RuntimeError("a bug")

    monkeypatch.setattr(server.state.metrics, "render", broken)
    error = assert_error(server.http().get("/metrics"), 500)
    assert error["type"] == "server_error" and "a bug" not in error["message"]
    assert any("a bug" in (r.exc_text or "") or "a bug" in str(r.exc_info) for r in caplog.records)
    monkeypatch.undo()
    assert server.http().get("/metrics").status_code == 200 and http_ok(server)
