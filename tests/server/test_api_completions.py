"""POST /v1/completions through the official OpenAI SDK, against the tiny model served live."""

import json

import openai
import pytest
from live_server import TEST_DEVICE

from infero.engine.sampling import SamplingParams


def test_echo_with_logprobs_scores_the_prompt_too(server, tiny_llm):
    prompt = "hello the world"
    prompt_ids = tiny_llm.tokenizer.encode(prompt)
    r = server.client().completions.create(
        model="tiny", prompt=prompt, max_tokens=4, echo=True, logprobs=2, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    choice = r.choices[0]
    lp = choice.logprobs
    assert choice.text.startswith(prompt)
    assert len(lp.tokens) == len(prompt_ids) + 4
    assert "".join(lp.tokens[: len(prompt_ids)]) == prompt
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    assert all(1 <= len(top) <= 2 for top in lp.top_logprobs[1:])
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert r.usage.prompt_tokens == len(prompt_ids) and r.usage.completion_tokens == 4


def test_echo_with_zero_max_tokens_only_scores_the_prompt(server, tiny_llm):
    prompt = "hello world and the"
    r = server.client().completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=0)
    choice = r.choices[0]
    assert choice.text == prompt and choice.finish_reason == "length"
    assert len(choice.logprobs.token_logprobs) == len(tiny_llm.tokenizer.encode(prompt))
    assert r.usage.completion_tokens == 0
    server.wait_idle()


def test_prompt_logprobs_agree_with_the_logprobs_of_generated_tokens(server, tiny_llm):
    prompt_ids = tiny_llm.tokenizer.encode("hello")
    params = SamplingParams(max_tokens=2, temperature=0, logprobs=0, ignore_eos=True)
    [generated] = tiny_llm.generate([prompt_ids], params)
    scored = server.client().completions.create(
        model="tiny", prompt=prompt_ids + generated.completion_ids, max_tokens=0, echo=True, logprobs=0
    )
    # a prompt position is scored from the same prefix the generated token was sampled from; tiny_llm computes
    # on the CPU, so a server on the GPU agrees to its kernels' rounding (logits ~1e-3 relative), not to 1e-4
    got = scored.choices[0].logprobs.token_logprobs[-2:]
    tolerance = 1e-4 if TEST_DEVICE == "cpu" else 2e-3
    assert got == pytest.approx([lp.logprob for lp in generated.logprobs], abs=tolerance)


def test_vllms_prompt_logprobs_rank_each_prompt_token_as_the_sampler_ranks_it(server, tiny_llm):
    """vLLM's prompt_logprobs: a greedy token at rank 1, the sampler's second choice at rank 2, each with the
    logprob it was sampled with, and the top-N ranked 1..N."""
    prompt_ids = tiny_llm.tokenizer.encode("hello the")
    params = SamplingParams(max_tokens=3, temperature=0, logprobs=2, ignore_eos=True)
    [greedy] = tiny_llm.generate([prompt_ids], params)
    second, second_logprob = greedy.logprobs[-1].top[1]
    scored_ids = prompt_ids + greedy.completion_ids[:-1] + [second]
    r = server.http().post("/v1/completions", json={"model": "tiny", "prompt": scored_ids, "max_tokens": 1,
                                                    "prompt_logprobs": 3})  # fmt: skip
    assert r.status_code == 200, r.text
    entries = r.json()["choices"][0]["prompt_logprobs"]
    assert len(entries) == len(scored_ids) and entries[0] is None
    tolerance = 1e-4 if TEST_DEVICE == "cpu" else 2e-3
    for position, expected in zip(range(len(prompt_ids), len(scored_ids) - 1), greedy.logprobs, strict=False):
        token = entries[position][str(scored_ids[position])]
        assert token["rank"] == 1 and token["logprob"] == pytest.approx(expected.logprob, abs=tolerance)
    last = entries[-1][str(second)]
    assert last["rank"] == 2 and last["logprob"] == pytest.approx(second_logprob, abs=tolerance)
    assert last["decoded_token"] == tiny_llm.tokenizer.decode([second])
    for entry in entries[1:]:
        ranked = sorted(entry.values(), key=lambda e: e["rank"])
        assert [e["rank"] for e in ranked][:3] == [1, 2, 3] and 3 <= len(entry) <= 4
        assert [e["logprob"] for e in ranked] == sorted((e["logprob"] for e in ranked), reverse=True)
    server.wait_idle()


def test_prompt_logprobs_beside_echo_keep_each_its_own_width(server):
    body = {"model": "tiny", "prompt": "hello the world", "max_tokens": 2, "echo": True, "logprobs": 1,
            "prompt_logprobs": 4, "n": 2, "seed": 3}  # fmt: skip
    r = server.http().post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert choices[0]["prompt_logprobs"] == choices[1]["prompt_logprobs"]  # one prompt, n choices
    prompt_len = r.json()["usage"]["prompt_tokens"]
    assert len(choices[0]["prompt_logprobs"]) == prompt_len
    assert all(4 <= len(e) <= 5 for e in choices[0]["prompt_logprobs"][1:])
    assert all(len(top) == 1 for top in choices[0]["logprobs"]["top_logprobs"][1:])
    plain = server.http().post("/v1/completions", json={**body, "prompt_logprobs": None})
    assert "prompt_logprobs" not in plain.json()["choices"][0]
    echoed = plain.json()["choices"][0]["logprobs"]["token_logprobs"]
    assert echoed[:prompt_len] == choices[0]["logprobs"]["token_logprobs"][:prompt_len]


@pytest.mark.parametrize(
    "extra, message",
    [({"prompt_logprobs": 1, "stream": True}, "not available when streaming"),
     ({"prompt_logprobs": -1}, "whole vocabulary's logprobs (-1)"),
     ({"prompt_logprobs": 21}, "--max-logprobs 20")],
)  # fmt: skip
def test_prompt_logprobs_out_of_reach_are_a_400_that_says_why(server, extra, message):
    for route, body in (
        ("/v1/completions", {"prompt": "hello"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ):
        r = server.http().post(route, json={"model": "tiny", "max_tokens": 2, **body, **extra})
        assert r.status_code == 400 and message in r.json()["error"]["message"], r.text


def test_a_list_of_prompts_gives_choices_prompt_major(server):
    r = server.client().completions.create(
        model="tiny", prompt=["hello", "the world"], n=2, max_tokens=3, echo=True, seed=9,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text.startswith("hello") for c in r.choices] == [True, True, False, False]
    assert all(c.text.startswith("the world") for c in r.choices[2:])
    assert r.usage.completion_tokens == 12


def test_token_id_prompts_work_like_text(server, tiny_llm):
    client = server.client()
    ids = tiny_llm.tokenizer.encode("hello world")
    a = client.completions.create(model="tiny", prompt="hello world", max_tokens=6, temperature=0)
    b = client.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0)
    c = client.completions.create(model="tiny", prompt=[ids, ids], max_tokens=6, temperature=0)
    assert a.choices[0].text == b.choices[0].text == c.choices[0].text == c.choices[1].text
    assert b.usage.prompt_tokens == len(ids) and c.usage.prompt_tokens == 2 * len(ids)


def test_streaming_completion_matches_non_streaming(server):
    client = server.client()
    kwargs = dict(model="tiny", prompt=["hello", "the"], max_tokens=10, temperature=0, echo=True, logprobs=1)
    full = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    for i in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == i]
        assert "".join(c.text for c in mine) == full.choices[i].text
        assert [t for c in mine for t in c.logprobs.tokens] == full.choices[i].logprobs.tokens
        assert [o for c in mine for o in c.logprobs.text_offset] == full.choices[i].logprobs.text_offset
        assert mine[-1].finish_reason == full.choices[i].finish_reason
    assert chunks[-1].usage == full.usage and chunks[-1].choices == []


def test_return_token_ids_give_each_choice_its_prompt_and_output_tokens_streamed_or_not(server, tiny_llm):
    """vLLM's return_token_ids: the ids the engine read and sampled, which decode to the choice's text."""
    body = {"model": "tiny", "prompt": ["hello", "the world"], "max_tokens": 6, "temperature": 0, "echo": True,
            "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    full = server.http().post("/v1/completions", json=body).json()
    for choice, prompt in zip(full["choices"], body["prompt"], strict=True):
        assert choice["prompt_token_ids"] == tiny_llm.tokenizer.encode(prompt)
        assert len(choice["token_ids"]) == 6
        assert choice["text"] == prompt + tiny_llm.tokenizer.decode(choice["token_ids"])
    chunks = [json.loads(line[6:]) for line in server.http().post(
        "/v1/completions", json={**body, "stream": True}).text.splitlines() if line.startswith("data: {")]  # fmt: skip
    for i, choice in enumerate(full["choices"]):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == i]
        assert mine[0]["prompt_token_ids"] == choice["prompt_token_ids"]
        assert all("prompt_token_ids" not in c for c in mine[1:])
        assert [t for c in mine for t in c["token_ids"]] == choice["token_ids"]
    scored = server.http().post("/v1/completions", json={**body, "max_tokens": 0}).json()
    assert [c["token_ids"] for c in scored["choices"]] == [[], []]  # max_tokens 0 generates nothing
    assert "token_ids" not in server.http().post("/v1/completions", json={**body, "return_token_ids": False}).json()[
        "choices"][0]  # fmt: skip


def test_return_tokens_as_token_ids_name_each_logprob_token_by_its_id(server, fresh_server):
    """vLLM's return_tokens_as_token_ids (per request, or --return-tokens-as-token-ids for all): tokens "token_id:N",
    the rest of the logprobs as they were."""
    body = {"model": "tiny", "prompt": "hello the", "max_tokens": 4, "temperature": 0, "echo": True, "logprobs": 2,
            "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    plain = server.http().post("/v1/completions", json=body).json()["choices"][0]
    named = (
        server.http().post("/v1/completions", json={**body, "return_tokens_as_token_ids": True}).json()["choices"][0]
    )
    ids = named["prompt_token_ids"] + named["token_ids"]
    assert named["logprobs"]["tokens"] == [f"token_id:{i}" for i in ids]
    assert named["logprobs"]["text_offset"] == plain["logprobs"]["text_offset"]
    assert named["logprobs"]["token_logprobs"] == plain["logprobs"]["token_logprobs"]
    for top in named["logprobs"]["top_logprobs"][1:]:
        assert all(key.startswith("token_id:") and int(key[9:]) >= 0 for key in top)
    live = fresh_server(return_tokens_as_token_ids=True)
    assert live.http().post("/v1/completions", json=body).json()["choices"][0]["logprobs"] == named["logprobs"]
    off = live.http().post("/v1/completions", json={**body, "return_tokens_as_token_ids": False}).json()
    assert off["choices"][0]["logprobs"] == plain["logprobs"]


def test_seeds_repeat_and_stop_token_ids_stop(server, tiny_llm):
    client = server.client()
    a = client.completions.create(model="tiny", prompt="hello", max_tokens=8, seed=42, temperature=1.0)
    b = client.completions.create(model="tiny", prompt="hello", max_tokens=8, seed=42, temperature=1.0)
    assert a.choices[0].text == b.choices[0].text
    [h] = tiny_llm.tokenizer.encode("h", add_special_tokens=False)
    r = client.completions.create(model="tiny", prompt="hello", max_tokens=8, temperature=0, logit_bias={str(h): 100},
                                  extra_body={"stop_token_ids": [h]})  # fmt: skip
    # the stop token ends the text and is not part of it
    assert r.choices[0].text == "" and r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 1


@pytest.mark.parametrize(
    "extra, match",
    [
        ({"suffix": "end"}, "suffix"),
        ({"best_of": 3}, "best_of"),
        ({"prompt": []}, "empty"),
        ({"prompt": [[1, 2], "x"]}, "prompt"),
        ({"prompt": [10**9]}, "outside the vocabulary"),
        ({"logprobs": 21}, "logprobs"),
        ({"max_tokens": 0}, "echo"),
        ({"max_tokens": -1}, "max_tokens"),
    ],
)
def test_invalid_completion_requests_are_400(server, extra, match):
    r = server.http().post("/v1/completions", json={"model": "tiny", "prompt": "hello", **extra})
    assert r.status_code == 400, r.text
    assert match in r.json()["error"]["message"]


def test_an_unknown_model_is_404_in_the_sdk(server):
    with pytest.raises(openai.NotFoundError) as e:
        server.client().completions.create(model="gpt-4", prompt="hello", max_tokens=1)
    assert e.value.body["code"] == "model_not_found"


def test_include_stop_str_in_output_keeps_the_stop_string_as_vllm_does(server):
    http = server.http()
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    text = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    stop = text[3:5]
    assert len(stop) == 2 and text.find(stop) == 3, text
    cut = http.post("/v1/completions", json={**body, "stop": [stop]}).json()["choices"][0]
    kept = http.post("/v1/completions", json={**body, "stop": [stop], "include_stop_str_in_output": True}).json()
    assert cut["text"] == text[:3] and cut["finish_reason"] == "stop"
    assert kept["choices"][0]["text"] == text[:5] and kept["choices"][0]["finish_reason"] == "stop"


def test_stop_reason_names_the_stop_string_or_token_that_ended_a_choice_as_vllm_does(server, tiny_llm):
    http = server.http()
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    text = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    [greedy] = tiny_llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    token = greedy.completion_ids[2]
    assert token not in greedy.completion_ids[:2]
    stop = text[3:5]
    choice = http.post("/v1/completions", json={**body, "stop": ["zzz", stop]}).json()["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop)
    assert http.post("/v1/completions", json=body).json()["choices"][0]["stop_reason"] is None  # length
    choice = http.post("/v1/completions", json={**body, "stop_token_ids": [token]}).json()["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", token)
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 12, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    said = http.post("/v1/chat/completions", json=chat).json()["choices"][0]["message"]["content"]
    stopped = http.post("/v1/chat/completions", json={**chat, "stop": [said[2:4]]}).json()["choices"][0]
    assert stopped["stop_reason"] == said[2:4] and stopped["finish_reason"] == "stop"
    with http.stream("POST", "/v1/chat/completions", json={**chat, "stop": [said[2:4]], "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert events[-1]["choices"][0]["stop_reason"] == said[2:4]
    assert all(e["choices"][0]["stop_reason"] is None for e in events[:-1])


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens_as_vllm_does(server):
    http = server.http()
    ids = [(7 * i) % 250 + 3 for i in range(40)]
    body = {"model": "tiny", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    kept = http.post("/v1/completions", json={**body, "prompt": ids, "truncate_prompt_tokens": 9}).json()
    tail = http.post("/v1/completions", json={**body, "prompt": ids[-9:]}).json()
    assert kept["usage"]["prompt_tokens"] == 9 and kept["choices"][0]["text"] == tail["choices"][0]["text"]
    text = "hello world the ing and tion 12 " * 40  # ~280 tokens, past the tiny model's 256
    assert http.post("/v1/completions", json={**body, "prompt": text}).status_code == 400
    r = http.post("/v1/completions", json={**body, "prompt": text, "truncate_prompt_tokens": 20})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 20, r.text
    # -1 keeps as many as the context holds, which leaves no room for an answer (as in vLLM); a short prompt is whole
    r = http.post("/v1/completions", json={**body, "prompt": text, "truncate_prompt_tokens": -1})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = http.post("/v1/completions", json={**body, "prompt": ids, "truncate_prompt_tokens": -1})
    assert r.json()["usage"]["prompt_tokens"] == 40
    chat = {
        "model": "tiny",
        "max_tokens": 2,
        "messages": [{"role": "user", "content": text}],
        "truncate_prompt_tokens": 30,
    }
    assert http.post("/v1/chat/completions", json=chat).json()["usage"]["prompt_tokens"] == 30
    for bad in (257, 0, -2):
        r = http.post("/v1/completions", json={**body, "prompt": "hi", "truncate_prompt_tokens": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens"


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_stats_puts_the_usage_so_far_in_every_chunk(server, route):
    body = {"model": "tiny", "max_tokens": 5, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}  # fmt: skip
    body.update({"messages": [{"role": "user", "content": "hello"}]} if "chat" in route else {"prompt": "hello"})
    with server.http().stream("POST", route, json=body) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    counts = [e["usage"]["completion_tokens"] for e in events]
    assert all(e["usage"]["prompt_tokens"] == events[-1]["usage"]["prompt_tokens"] for e in events)
    assert counts == sorted(counts) and counts[-1] == 5 and events[-1]["choices"] == []
    plain = {**body, "stream_options": {"include_usage": True}}
    with server.http().stream("POST", route, json=plain) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert all(e["usage"] is None for e in events[:-1]) and events[-1]["usage"]["completion_tokens"] == 5
