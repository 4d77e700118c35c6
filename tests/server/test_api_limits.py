"""Requests that can never run are 400s that say why, answered early and cheaply: more prompts than may ever
wait, a completion that cannot fit the context, a tool whose parameters are no JSON Schema, a 30 MB prompt."""

import json
import threading
import time

import openai
import pytest

HELLO = [{"role": "user", "content": "hello"}]


def assert_error(r, status: int, code: str | None = None, param: str | None = None) -> str:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code and (param is None or error["param"] == param)
    return error["message"]


def test_more_prompts_than_may_ever_wait_is_400_naming_the_limit_and_fewer_run(fresh_server):
    live = fresh_server(max_waiting_requests=4)
    http = live.http()
    message = assert_error(http.post("/v1/completions", json={"prompt": ["a"] * 5, "max_tokens": 1}), 400,
                           "too_many_prompts", "prompt")  # fmt: skip
    assert "5 prompts" in message and "--max-waiting-requests 4" in message
    with pytest.raises(openai.BadRequestError):  # the SDK retries a 503 forever, never a 400
        live.client().with_options(max_retries=2).completions.create(model="tiny", prompt=[[1, 2]] * 600, max_tokens=1)
    r = http.post("/v1/completions", json={"prompt": ["a"] * 4, "max_tokens": 1})
    assert r.status_code == 200 and len(r.json()["choices"]) == 4
    live.wait_idle()


def test_six_hundred_prompts_are_400_at_the_default_limit_before_any_is_encoded(server, monkeypatch):
    def no_encoding(*args, **kwargs):
        raise AssertionError("a prompt was encoded")

    monkeypatch.setattr(server.state.engine.tokenizer, "encode_bounded", no_encoding)
    r = server.http().post("/v1/completions", json={"model": "tiny", "prompt": ["hello there"] * 600})
    assert "lets at most 512 wait at once" in assert_error(r, 400, "too_many_prompts")


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
@pytest.mark.parametrize("requested", [300, 100_000, 2**70])
def test_a_chat_completion_that_cannot_fit_the_context_is_400_with_the_numbers(server, tiny_llm, field, requested):
    prompt = len(tiny_llm.encode_chat(HELLO))
    r = server.http().post("/v1/chat/completions", json={"messages": HELLO, field: requested})
    message = assert_error(r, 400, "context_length_exceeded", "messages")
    assert message == (
        f"This model's maximum context length is 256 tokens. However, you requested {prompt + requested} tokens "
        f"({prompt} in the messages, {requested} in the completion). Please reduce the length of the messages or "
        "completion."
    )


def test_a_completion_that_just_fits_runs_to_its_length(server, tiny_llm):
    client = server.client()
    prompt = len(tiny_llm.encode_chat(HELLO))
    extra = {"ignore_eos": True}
    r = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=256 - prompt, extra_body=extra)
    assert r.usage.completion_tokens == 256 - prompt and r.choices[0].finish_reason == "length"
    r = client.chat.completions.create(model="tiny", messages=HELLO, extra_body=extra)  # none given: to the end
    assert r.usage.completion_tokens == 256 - prompt
    ids = tiny_llm.tokenizer.encode("hello world")
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="hello world", max_tokens=257 - len(ids))
    assert e.value.code == "context_length_exceeded" and e.value.param == "prompt"
    assert f"({len(ids)} in the prompt, {257 - len(ids)} in the completion)" in e.value.message
    # OpenAI's default max_tokens (16) is not a request to fit: it runs until the context's end
    r = client.completions.create(model="tiny", prompt=[5] * 250, extra_body=extra)
    assert r.usage.completion_tokens == 6 and r.choices[0].finish_reason == "length"
    server.wait_idle()


@pytest.mark.parametrize("tool_choice", [None, "auto", "none", "required"])
def test_a_tool_whose_parameters_are_not_a_json_schema_is_400_whatever_the_tool_choice(server, tool_choice):
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}
    body = {"messages": HELLO, "tools": [tool], "max_tokens": 1}
    if tool_choice is not None:
        body["tool_choice"] = tool_choice
    message = assert_error(server.http().post("/v1/chat/completions", json=body), 400, None,
                           "tools.0.function.parameters")  # fmt: skip
    assert "not a valid JSON Schema" in message and "type" in message
    good = {**tool, "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    r = server.http().post("/v1/chat/completions", json={**body, "tools": [good]})
    assert r.status_code == 200, r.text


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


class PeakRss:
    """The highest resident size of this process (which runs the live server) while the block runs."""

    def __enter__(self):
        self.peak, self._stop = rss_bytes(), threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, rss_bytes())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


THIRTY_MB = "hello world " * (30_000_000 // 12)


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"prompt": THIRTY_MB}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": THIRTY_MB}]}, "messages"),
        ("/tokenize", {"prompt": THIRTY_MB}, "prompt"),
        ("/tokenize", {"messages": [{"role": "user", "content": THIRTY_MB}]}, "messages"),
    ],
)
def test_a_thirty_megabyte_prompt_is_400_in_seconds_and_bounded_memory(server, path, body, param):
    http = server.http()
    data = json.dumps({"model": "tiny", **body}).encode()
    before = rss_bytes()
    for _ in range(3):
        start = time.perf_counter()
        with PeakRss() as peak:
            r = http.post(path, content=data, headers={"Content-Type": "application/json"})
        elapsed = time.perf_counter() - start
        message = assert_error(r, 400, "context_length_exceeded", param)
        assert message.startswith("This model's maximum context length is 256 tokens. However, your request has")
        assert "has at least" in message
        assert message.endswith(f"tokens in the {param}. Please reduce the length of the {param}.")
        assert elapsed < 5.0
        # The body arrives and is parsed (a few copies of 30 MB); no tokenization of it (gigabytes) happens.
        assert peak.peak - before < 400 << 20, (peak.peak - before) >> 20
    # What stays resident is the allocator keeping freed body buffers (in each worker thread's arena) for reuse.
    assert rss_bytes() - before < 256 << 20, (rss_bytes() - before) >> 20
    assert http.post("/tokenize", json={"prompt": "hello " * 20}).status_code == 200


def test_token_ids_over_the_context_are_refused_with_their_count(server):
    r = server.http().post("/v1/completions", json={"prompt": [[5, 6], [5] * 2_000_000], "echo": True})
    message = assert_error(r, 400, "context_length_exceeded", "prompt.1")
    assert "However, your request has 2000000 tokens in the prompt.1." in message


def test_tokenize_refuses_a_text_over_the_context_and_counts_one_within_it(server, tiny_llm):
    http = server.http()
    text = "hello world " * 200
    ids = tiny_llm.tokenizer.encode(text)
    assert len(ids) > 256
    message = assert_error(http.post("/tokenize", json={"prompt": text}), 400, "context_length_exceeded", "prompt")
    assert "maximum context length is 256 tokens" in message
    fits = "hello world " * 20
    assert http.post("/tokenize", json={"prompt": fits}).json()["count"] == len(tiny_llm.tokenizer.encode(fits))


def test_models_retrieve_gives_the_served_model_and_404_for_another(server):
    client = server.client()
    card = client.models.retrieve("tiny")
    assert card.id == "tiny" and card.object == "model" and card.max_model_len == 256
    assert client.models.list().data[0].model_dump() == card.model_dump()
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4o")
    assert e.value.code == "model_not_found" and "'gpt-4o' does not exist" in e.value.message
    message = assert_error(server.http().get("/v1/models/org/model-7b"), 404, "model_not_found", "model")
    assert "'org/model-7b'" in message
