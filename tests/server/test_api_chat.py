"""POST /v1/chat/completions through the official OpenAI SDK, against the tiny model served live."""

import json
import re

import httpx
import openai
import pytest
from live_server import TINY_ENGINE

from infero.llm import LLM

HELLO = [{"role": "user", "content": "hello"}]


def test_streaming_chat_gives_the_same_text_as_non_streaming_at_temperature_zero(server):
    client = server.client()
    full = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=24, temperature=0)
    chunks = list(
        client.chat.completions.create(
            model="tiny", messages=HELLO, max_tokens=24, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    assert full.object == "chat.completion" and full.id.startswith("chatcmpl-") and full.system_fingerprint
    assert full.choices[0].message.role == "assistant"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == full.usage.total_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens  # the second finds the first's prefix cached
    assert all(c.usage is None for c in chunks[:-1])
    server.wait_idle()


def test_usage_counts_the_rendered_prompt_and_every_generated_token(server, tiny_llm):
    messages = [{"role": "system", "content": "be brief"}, *HELLO]
    r = server.client().chat.completions.create(
        model="tiny", messages=messages, max_tokens=9, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.usage.prompt_tokens == len(tiny_llm.encode_chat(messages))
    assert r.usage.completion_tokens == 9 and r.choices[0].finish_reason == "length"
    assert r.usage.total_tokens == r.usage.prompt_tokens + 9


def test_content_parts_render_like_a_string_and_tool_turns_are_accepted(server, tiny_llm):
    client = server.client()
    as_parts = [{"role": "user", "content": [{"type": "text", "text": "hel"}, {"type": "text", "text": "lo"}]}]
    a = client.chat.completions.create(model="tiny", messages=as_parts, max_tokens=4, temperature=0)
    assert a.usage.prompt_tokens == len(tiny_llm.encode_chat([{"role": "user", "content": "hel\nlo"}]))
    tool_turns = [
        *HELLO,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "3"},
    ]  # fmt: skip
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    r = client.chat.completions.create(model="tiny", messages=tool_turns, tools=tools, max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_logprobs_come_in_the_chat_shape(server):
    r = server.client().chat.completions.create(
        model="tiny", messages=HELLO, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    content = r.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert entry.logprob <= 0 and isinstance(entry.bytes, list) and len(entry.top_logprobs) == 3
        # greedy: the chosen token is the most likely one
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
    # the tokens' bytes, joined, are the text (a token may hold half a character)
    assert bytes(b for e in content for b in e.bytes).decode("utf-8", "replace") == r.choices[0].message.content


def test_prompt_logprobs_of_a_conversation_are_those_of_its_rendered_prompt(server):
    """vLLM's prompt_logprobs on chat: one list beside the choices, as /v1/completions scores the same token ids."""
    http = server.http()
    chat = http.post("/v1/chat/completions", json={"model": "tiny", "messages": HELLO, "max_tokens": 2,
                                                   "prompt_logprobs": 2})  # fmt: skip
    assert chat.status_code == 200, chat.text
    ids = http.post("/tokenize", json={"model": "tiny", "messages": HELLO}).json()["tokens"]
    completion = http.post("/v1/completions", json={"model": "tiny", "prompt": ids, "max_tokens": 1,
                                                    "prompt_logprobs": 2})  # fmt: skip
    got, expected = chat.json()["prompt_logprobs"], completion.json()["choices"][0]["prompt_logprobs"]
    assert len(got) == len(ids) == chat.json()["usage"]["prompt_tokens"] and got[0] is None
    for a, b in zip(got[1:], expected[1:], strict=True):
        assert {k: (v["rank"], v["decoded_token"]) for k, v in a.items()} == (
            {k: (v["rank"], v["decoded_token"]) for k, v in b.items()}
        )
        assert [v["logprob"] for v in a.values()] == pytest.approx([v["logprob"] for v in b.values()], abs=1e-5)
    assert "prompt_logprobs" not in http.post("/v1/chat/completions", json={"model": "tiny", "messages": HELLO,
                                                                            "max_tokens": 2}).json()  # fmt: skip


def test_return_token_ids_give_the_prompt_and_each_choices_tokens_streamed_or_not(server, tiny_llm):
    """vLLM's return_token_ids: prompt_token_ids beside the choices (in streams on the role chunks), each choice's
    token_ids in order, decoding to its text."""
    http = server.http()
    body = {"model": "tiny", "messages": HELLO, "max_tokens": 7, "n": 2, "seed": 5, "ignore_eos": True,
            "return_token_ids": True}  # fmt: skip
    full = http.post("/v1/chat/completions", json=body).json()
    assert (
        full["prompt_token_ids"] == http.post("/tokenize", json={"model": "tiny", "messages": HELLO}).json()["tokens"]
    )
    for choice in full["choices"]:
        assert len(choice["token_ids"]) == 7
        assert choice["message"]["content"] == tiny_llm.tokenizer.decode(choice["token_ids"])
    chunks = [json.loads(line[6:]) for line in http.post("/v1/chat/completions", json={**body, "stream": True})
              .text.splitlines() if line.startswith("data: {")]  # fmt: skip
    roles = [c for c in chunks if c["choices"][0]["delta"].get("role")]
    assert len(roles) == 2 and all(c["prompt_token_ids"] == full["prompt_token_ids"] for c in roles)
    for i, choice in enumerate(full["choices"]):
        streamed = [t for c in chunks if c["choices"][0]["index"] == i for t in c["choices"][0].get("token_ids", [])]
        assert streamed == choice["token_ids"]  # a seeded request repeats, streamed or not
    plain = http.post("/v1/chat/completions", json={**body, "return_token_ids": False}).json()
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]


def test_return_tokens_as_token_ids_name_chat_logprob_tokens_by_id(server):
    body = {"model": "tiny", "messages": HELLO, "max_tokens": 4, "temperature": 0, "logprobs": True,
            "top_logprobs": 2, "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    plain = server.http().post("/v1/chat/completions", json=body).json()["choices"][0]
    named = server.http().post("/v1/chat/completions", json={**body, "return_tokens_as_token_ids": True}).json()
    content = named["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in content] == [f"token_id:{i}" for i in named["choices"][0]["token_ids"]]
    assert [e["bytes"] for e in content] == [e["bytes"] for e in plain["logprobs"]["content"]]
    assert all(t["token"].startswith("token_id:") for e in content for t in e["top_logprobs"])


def test_echo_repeats_the_message_the_model_continues_streamed_or_not(server):
    """vLLM's chat echo: with continue_final_message the answer's content begins with the last message's; after a
    user message with a generation prompt there is nothing to repeat."""
    http = server.http()
    partial = [*HELLO, {"role": "assistant", "content": [{"type": "text", "text": "The answer"},
                                                          {"type": "text", "text": "is"}]}]  # fmt: skip
    body = {"model": "tiny", "messages": partial, "continue_final_message": True, "max_tokens": 6,
            "temperature": 0, "ignore_eos": True, "n": 2}  # fmt: skip
    plain = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
    echoed = http.post("/v1/chat/completions", json={**body, "echo": True}).json()
    assert [c["message"]["content"] for c in echoed["choices"]] == ["The answer\nis" + plain] * 2
    assert echoed["usage"]["completion_tokens"] == 12  # the echoed text is the prompt's, not generated
    chunks = [json.loads(line[6:]) for line in http.post("/v1/chat/completions", json={**body, "echo": True,
              "stream": True}).text.splitlines() if line.startswith("data: {")]  # fmt: skip
    for i in (0, 1):
        deltas = [c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"][0]["index"] == i]
        assert "".join(deltas) == "The answer\nis" + plain
    after_user = http.post("/v1/chat/completions", json={"model": "tiny", "messages": HELLO, "max_tokens": 4,
                                                         "temperature": 0, "echo": True}).json()  # fmt: skip
    alone = http.post("/v1/chat/completions", json={"model": "tiny", "messages": HELLO, "max_tokens": 4,
                                                    "temperature": 0}).json()  # fmt: skip
    assert after_user["choices"][0]["message"]["content"] == alone["choices"][0]["message"]["content"]


def test_seeded_sampling_repeats_and_n_choices_differ(server):
    client = server.client()

    def sample():
        r = client.chat.completions.create(
            model="tiny", messages=HELLO, max_tokens=12, temperature=1.0, seed=1234, n=3,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert [c.index for c in r.choices] == [0, 1, 2]
        return [c.message.content for c in r.choices]

    first = sample()
    assert sample() == first
    assert len(set(first)) == 3


def test_n_choices_stream_interleaved_with_their_indexes(server):
    chunks = list(
        server.client().chat.completions.create(
            model="tiny", messages=HELLO, max_tokens=6, n=2, seed=3, stream=True, extra_body={"ignore_eos": True}
        )
    )
    by_index = {0: [], 1: []}
    for c in chunks:
        by_index[c.choices[0].index].append(c.choices[0])
    for choices in by_index.values():
        assert choices[0].delta.role == "assistant"
        assert [c.finish_reason for c in choices if c.finish_reason] == ["length"]
    full = server.client().chat.completions.create(
        model="tiny", messages=HELLO, max_tokens=6, n=2, seed=3, extra_body={"ignore_eos": True}
    )
    for i, choices in by_index.items():
        assert "".join(c.delta.content or "" for c in choices) == full.choices[i].message.content
    server.wait_idle()


def test_a_stop_string_ends_the_text_before_it(server):
    client = server.client()
    base = client.chat.completions.create(
        model="tiny", messages=HELLO, max_tokens=20, temperature=0, extra_body={"ignore_eos": True}
    )
    text = base.choices[0].message.content
    stop = text[5:8]
    assert len(stop) == 3 and text.find(stop) >= 1
    for stream in (False, True):
        r = client.chat.completions.create(
            model="tiny", messages=HELLO, max_tokens=20, temperature=0, stop=[stop, "never appears"], stream=stream
        )
        if stream:
            chunks = list(r)
            got = "".join(c.choices[0].delta.content or "" for c in chunks)
            reason = chunks[-1].choices[0].finish_reason
        else:
            got, reason = r.choices[0].message.content, r.choices[0].finish_reason
        assert got == text[: text.find(stop)] and reason == "stop"


def test_max_completion_tokens_wins_over_max_tokens(server):
    r = server.client().chat.completions.create(
        model="tiny", messages=HELLO, max_tokens=10, max_completion_tokens=3, extra_body={"ignore_eos": True}
    )
    assert r.usage.completion_tokens == 3


def test_sampling_extensions_reach_the_engine(server, tiny_llm):
    client = server.client()
    [h] = tiny_llm.tokenizer.encode("h", add_special_tokens=False)
    # A logit bias of +100 on one token makes it the only choice
    r = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=4, temperature=0,
                                       logit_bias={str(h): 100})  # fmt: skip
    assert r.choices[0].message.content == "hhhh"
    r = client.chat.completions.create(
        model="tiny", messages=HELLO, max_tokens=8, temperature=0.7, top_p=0.9, presence_penalty=0.5,
        frequency_penalty=0.5, user="someone",
        extra_body={"top_k": 5, "min_p": 0.01, "repetition_penalty": 1.1, "min_tokens": 8, "stop_token_ids": [2],
                    "skip_special_tokens": False, "chat_template_kwargs": {"enable_thinking": False}},
    )  # fmt: skip
    assert r.usage.completion_tokens == 8


def test_response_format_and_tools_are_validated(server):
    http = server.http()
    body = {"model": "tiny", "messages": HELLO, "max_tokens": 2}
    assert http.post("/v1/chat/completions", json={**body, "response_format": {"type": "text"}}).status_code == 200
    bad = [
        {"response_format": {"type": "json_schema"}},
        {"response_format": {"type": "yaml"}},
        {"tool_choice": "required"},
        {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function",
                                                                               "function": {"name": "g"}}},
        {"tools": [{"type": "retrieval"}]},
        {"chat_template_kwargs": {"messages": []}},
    ]  # fmt: skip
    for extra in bad:
        r = http.post("/v1/chat/completions", json={**body, **extra})
        assert r.status_code == 400, (extra, r.text)
        assert r.json()["error"]["type"] == "invalid_request_error"


def test_a_chat_message_with_an_image_part_is_a_400(server):
    with pytest.raises(openai.BadRequestError, match="text only"):
        server.client().chat.completions.create(
            model="tiny", max_tokens=2,
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}],
        )  # fmt: skip


def test_a_disconnect_mid_stream_aborts_the_request_and_frees_its_blocks(fresh_server):
    live = fresh_server(step_delay=0.01)
    body = {"model": "tiny", "messages": HELLO, "max_tokens": 200, "stream": True, "ignore_eos": True}
    with httpx.Client(base_url=live.url, timeout=30) as http:
        with http.stream("POST", "/v1/chat/completions", json=body) as r:
            lines = r.iter_lines()
            for _ in range(6):
                next(lines)
            assert live.stats().kv_usage > 0
    live.wait_idle(timeout=2.0)
    text = live.http().get("/metrics").text
    assert 'infero:request_success_total{model_name="tiny",finished_reason="abort"} 1' in text


def test_a_client_that_gives_up_on_a_non_streaming_request_frees_its_blocks(fresh_server):
    live = fresh_server(step_delay=0.01)
    body = {"model": "tiny", "messages": HELLO, "max_tokens": 200, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(live.url + "/v1/chat/completions", json=body, timeout=0.3)
    live.wait_idle(timeout=2.0)


def test_response_format_json_schema_constrains_the_answer(server):
    schema = {
        "type": "object",
        "additionalProperties": False,
        "required": ["answer", "n"],
        "properties": {"answer": {"enum": ["yes", "no"]}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    }
    response_format = {"type": "json_schema", "json_schema": {"name": "reply", "schema": schema}}
    client = server.client()
    for seed in (1, 2):
        r = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=50, seed=seed,
                                           response_format=response_format)  # fmt: skip
        reply = json.loads(r.choices[0].message.content)
        assert reply["answer"] in ("yes", "no") and 0 <= reply["n"] <= 9 and r.choices[0].finish_reason == "stop"
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=HELLO, response_format=bad)
    assert e.value.param == "response_format"


def test_vllms_structured_outputs_and_guided_fields_constrain_the_answer(server):
    """vLLM's request fields for constrained output: structured_outputs {json, regex, choice, grammar, json_object}
    and the guided_* fields it took before (tiny random model: only the constraint makes these answers)."""
    http = server.http()

    def answer(route: str = "/v1/chat/completions", **extra) -> str:
        body = {"model": "tiny", "max_tokens": 30, "seed": 3, **extra}
        body.update({"messages": HELLO} if "chat" in route else {"prompt": "hello"})
        r = http.post(route, json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return choice["message"]["content"] if "chat" in route else choice["text"]

    for extra in ({"structured_outputs": {"choice": ["yes", "no"]}}, {"guided_choice": ["yes", "no"]}):
        assert answer(**extra) in ("yes", "no") and answer("/v1/completions", **extra) in ("yes", "no")
    for extra in ({"structured_outputs": {"regex": "[0-9]{3}-[a-c]"}}, {"guided_regex": "[0-9]{3}-[a-c]"}):
        assert re.fullmatch("[0-9]{3}-[a-c]", answer(**extra))
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}  # fmt: skip
    for extra in ({"structured_outputs": {"json": schema}}, {"guided_json": json.dumps(schema)}):
        assert isinstance(json.loads(answer(max_tokens=60, **extra))["n"], int)
    assert isinstance(json.loads(answer(max_tokens=60, structured_outputs={"json_object": True})), dict)
    grammar = 'start: "ab" | "cd"'
    for extra in ({"structured_outputs": {"grammar": grammar}}, {"guided_grammar": grammar}):
        assert answer(**extra, guided_decoding_backend="guidance") in ("ab", "cd")


@pytest.mark.parametrize(
    "extra, param",
    [({"guided_choice": []}, "guided_choice"), ({"structured_outputs": {"regex": ""}}, "structured_outputs"),
     ({"structured_outputs": {"choice": ["a"], "disable_any_whitespace": True}},
      "structured_outputs.disable_any_whitespace"),
     ({"guided_regex": "(("}, "guided_regex"), ({"structured_outputs": {"grammar": "start: ("}}, "structured_outputs"),
     ({"guided_choice": ["a"], "guided_regex": "b"}, "guided_choice"),
     ({"response_format": {"type": "json_object"}, "guided_choice": ["a"]}, "guided_choice"),
     ({"guided_choice": ["a"], "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"},
      "guided_choice")],
)  # fmt: skip
def test_a_constraint_that_cannot_be_followed_is_a_400_naming_its_field(server, extra, param):
    body = {"model": "tiny", "messages": HELLO, "max_tokens": 2, **extra}
    r = server.http().post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_continue_final_message_and_add_generation_prompt_shape_the_prompt_as_vllms(server, tiny_llm):
    """The model goes on with a last assistant message (its end-of-turn cut) or starts no new turn at all; the
    prompt's length in usage is the rendered text's."""
    http = server.http()
    partial = [*HELLO, {"role": "assistant", "content": "hello wor"}]
    expected = {
        "continue": tiny_llm.encode_chat(partial, add_generation_prompt=False, continue_final_message=True),
        "no header": tiny_llm.encode_chat(HELLO, add_generation_prompt=False),
    }
    assert tiny_llm.render_chat(partial, add_generation_prompt=False, continue_final_message=True).endswith("hello wor")
    bodies = {"continue": {"messages": partial, "continue_final_message": True},
              "no header": {"messages": HELLO, "add_generation_prompt": False}}  # fmt: skip
    for name, body in bodies.items():
        r = http.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 2, **body})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(expected[name]), (name, r.text)
        assert http.post("/tokenize", json=body).json()["tokens"] == expected[name]
    both = {"model": "tiny", "max_tokens": 2, "messages": partial, "continue_final_message": True,
            "add_generation_prompt": True}  # fmt: skip
    r = http.post("/v1/chat/completions", json=both)
    assert r.status_code == 400 and "cannot both be true" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    "route, extra, param",
    [("/v1/completions", {"use_beam_search": True}, "use_beam_search"),
     ("/v1/chat/completions", {"allowed_token_ids": [5]}, "allowed_token_ids"),
     ("/v1/completions", {"bad_words": ["hello"]}, "bad_words"),
     ("/v1/chat/completions", {"logits_processors": ["x.Y"]}, "logits_processors")],
)  # fmt: skip
def test_vllms_fields_for_what_infero_does_not_do_are_refused_not_ignored(server, route, extra, param):
    body = {"model": "tiny", "max_tokens": 2, **extra}
    body.update({"messages": HELLO} if "chat" in route else {"prompt": "hello"})
    r = server.http().post(route, json=body)
    assert r.status_code == 400 and f"{param} is not supported" in r.json()["error"]["message"], r.text
    off = {k: False if isinstance(v, bool) else None for k, v in extra.items()}  # what vLLM's defaults are
    assert server.http().post(route, json={**body, **off}).status_code == 200


def test_documents_reach_a_template_that_cites_them(fresh_server, tmp_path, tiny_model_path):
    """vLLM's `documents` (RAG templates): handed to the template as `documents`."""
    template = tmp_path / "rag.jinja"
    template.write_text("{% for d in documents %}[{{ d.title }}: {{ d.text }}]{% endfor %}"
                        "{% for m in messages %}{{ m.content }}{% endfor %}")  # fmt: skip
    live = fresh_server(
        load=lambda: LLM(tiny_model_path, device="cpu", engine_config=TINY_ENGINE, chat_template=template)
    )
    body = {"model": "tiny", "max_tokens": 2, "messages": HELLO,
            "documents": [{"title": "a", "text": "one"}, {"title": "b", "text": "two"}]}  # fmt: skip
    with_docs = live.http().post("/v1/chat/completions", json=body).json()["usage"]["prompt_tokens"]
    r = live.http().post("/tokenize", json={"prompt": "[a: one][b: two]hello", "add_special_tokens": False})
    assert with_docs == r.json()["count"]


def test_default_chat_template_kwargs_lie_under_each_requests_own(fresh_server, tmp_path, tiny_model_path):
    """vllm serve's --default-chat-template-kwargs: every request's template variables, which its own override."""
    template = tmp_path / "vars.jinja"
    template.write_text("{{ greeting }}{% for m in messages %}{{ m.content }}{% endfor %}")
    load = lambda: LLM(tiny_model_path, device="cpu", engine_config=TINY_ENGINE, chat_template=template)  # noqa: E731
    live = fresh_server(load=load, default_chat_template_kwargs={"greeting": "hello world "})
    http = live.http()

    def rendered(**kwargs) -> list[int]:
        return http.post("/tokenize", json={"messages": HELLO, "add_generation_prompt": False, **kwargs}).json()[
            "tokens"
        ]

    def text(value: str) -> list[int]:
        return http.post("/tokenize", json={"prompt": value, "add_special_tokens": False}).json()["tokens"]

    assert rendered() == text("hello world hello")
    assert rendered(chat_template_kwargs={"greeting": "the "}) == text("the hello")
    chat = http.post("/v1/chat/completions", json={"messages": HELLO, "max_tokens": 1}).json()
    assert chat["usage"]["prompt_tokens"] == len(text("hello world hello"))
