"""Many clients at once, some rude: disconnects mid-stream, malformed JSON, oversize bodies, wrong types.

Afterwards the server answers every well-formed request as it did before, never said 500, and the engine holds
no request and no KV block.
"""

import asyncio
import json
import random

import httpx

from infero.engine.engine import EngineConfig

HELLO = [{"role": "user", "content": "hello"}]
GOOD_CHAT = {"model": "tiny", "messages": HELLO, "max_tokens": 30, "temperature": 0, "ignore_eos": True}
GOOD_COMPLETION = {"model": "tiny", "prompt": "the world", "max_tokens": 30, "temperature": 0, "ignore_eos": True}


async def stream_and_maybe_hang_up(client: httpx.AsyncClient, rng: random.Random, path: str, body: dict) -> int:
    """Read a stream; hang up after a random number of lines, or read it to [DONE] and check its shape."""
    hang_up_after = rng.choice([None, 0, 1, 3, 8])
    async with client.stream("POST", path, json={**body, "stream": True}) as r:
        if r.status_code != 200:
            await r.aread()
            return r.status_code
        events = []
        async for line in r.aiter_lines():
            if hang_up_after is not None and len(events) >= hang_up_after:
                return 200  # leaving the block closes the connection mid-stream
            if line:
                events.append(line)
        assert events[-1] == "data: [DONE]"
        finishes = [json.loads(e[6:])["choices"][0]["finish_reason"] for e in events[:-1]]
        assert finishes.count("length") == body.get("n", 1)
        return r.status_code


async def one_client(client: httpx.AsyncClient, i: int) -> tuple[str, int]:
    rng = random.Random(i)
    kind = ["stream_chat", "stream_completion", "chat", "completion", "malformed", "wrong_type", "unknown_model",
            "timeout"][i % 8]  # fmt: skip
    if kind == "stream_chat":
        return kind, await stream_and_maybe_hang_up(client, rng, "/v1/chat/completions", {**GOOD_CHAT, "n": 2})
    if kind == "stream_completion":
        return kind, await stream_and_maybe_hang_up(client, rng, "/v1/completions", GOOD_COMPLETION)
    if kind == "chat":
        r = await client.post("/v1/chat/completions", json=GOOD_CHAT)
        assert r.json()["usage"]["completion_tokens"] == 30
        return kind, r.status_code
    if kind == "completion":
        r = await client.post("/v1/completions", json={**GOOD_COMPLETION, "prompt": ["a", "b"], "logprobs": 2})
        assert [c["index"] for c in r.json()["choices"]] == [0, 1]
        return kind, r.status_code
    if kind == "malformed":
        body = [b'{"model": "tiny", "messages": [', b"\x00\x01garbage", b"{}" * 10, b"null"][rng.randrange(4)]
        return kind, (await client.post("/v1/chat/completions", content=body)).status_code
    if kind == "wrong_type":
        body = rng.choice([{**GOOD_CHAT, "max_tokens": "12"}, {**GOOD_CHAT, "messages": [{"role": "user"}]},
                           {**GOOD_COMPLETION, "prompt": [[1, 2], [3, "x"]]}, {**GOOD_COMPLETION, "n": -3},
                           {**GOOD_COMPLETION, "prompt": [1, 2, 10**12]}])  # fmt: skip
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        return kind, (await client.post(path, json=body)).status_code
    if kind == "unknown_model":
        return kind, (await client.post("/v1/completions", json={**GOOD_COMPLETION, "model": "nope"})).status_code
    try:  # a client that gives up on a non-streaming request
        r = await client.post("/v1/chat/completions", json={**GOOD_CHAT, "max_tokens": 100}, timeout=0.05)
        return kind, r.status_code
    except httpx.TimeoutException:
        return kind, 0


EXPECTED = {"stream_chat": {200}, "stream_completion": {200}, "chat": {200}, "completion": {200},
            "malformed": {400}, "wrong_type": {400}, "unknown_model": {404}, "timeout": {0, 200}}  # fmt: skip


def test_sixty_four_rude_and_polite_clients_leave_the_server_correct_and_idle(fresh_server):
    # A KV pool small enough that the crowd also forces a few preemptions; steps queued ahead where they can be.
    config = EngineConfig(max_num_seqs=64, kv_cache_bytes=2 << 20, max_num_batched_tokens=256, async_scheduling=True)
    live = fresh_server(config, step_delay=0.002)
    http = live.http()
    reference_chat = http.post("/v1/chat/completions", json=GOOD_CHAT).json()["choices"][0]["message"]["content"]
    reference_completion = http.post("/v1/completions", json=GOOD_COMPLETION).json()["choices"][0]["text"]

    async def crowd():
        limits = httpx.Limits(max_connections=128, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=live.url, timeout=60, limits=limits) as client:
            results = await asyncio.gather(*(one_client(client, i) for i in range(64)))
            oversize = b'{"prompt": "' + b"y" * (33 << 20) + b'"}'
            big = await client.post("/v1/completions", content=oversize)
            return results, big.status_code

    results, big_status = asyncio.run(crowd())
    assert big_status == 413
    for kind, status in results:
        assert status in EXPECTED[kind], (kind, status)
    live.wait_idle(timeout=5)
    assert live.stats().kv_usage == 0
    assert http.post("/v1/chat/completions", json=GOOD_CHAT).json()["choices"][0]["message"]["content"] == (
        reference_chat
    )
    assert http.post("/v1/completions", json=GOOD_COMPLETION).json()["choices"][0]["text"] == reference_completion
    metrics = http.get("/metrics").text
    assert 'finished_reason="abort"' in metrics


FUZZ_VALUES = [None, "", "x", -1, 0, 1, 2, 0.5, -0.5, 1e308, -1e308, 2**70, True, [], {}, [1, "a"], {"a": 1}, ["a"],
               [[1]], [{"role": "user", "content": "hi"}], "a" * 300, {"type": "text"}, {"type": "json_object"},
               [{"type": "function", "function": {"name": "f"}}], {"include_usage": True}]  # fmt: skip
FUZZ_FIELDS = ["model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p",
               "n", "stop", "stop_token_ids", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty",
               "logit_bias", "logprobs", "top_logprobs", "ignore_eos", "min_tokens", "chat_template_kwargs",
               "response_format", "tools", "tool_choice", "stream", "stream_options", "prompt", "echo", "suffix",
               "tokens", "add_special_tokens", "add_generation_prompt", "continue_final_message", "documents",
               "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
               "include_stop_str_in_output", "truncate_prompt_tokens", "parallel_tool_calls", "input", "instructions",
               "max_output_tokens", "text", "reasoning", "previous_response_id"]  # fmt: skip


FUZZ_BASES = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}]},
    "/v1/completions": {"prompt": "hi"},
    "/tokenize": {"prompt": "hi"},
    "/detokenize": {"tokens": [5, 6]},
    "/v1/responses": {"input": "hi", "max_output_tokens": 3},
}


def test_fields_with_random_values_never_make_a_500(server):
    rng = random.Random(0)
    http = server.http()
    statuses = set()
    for _ in range(400):
        path = rng.choice(list(FUZZ_BASES))
        body = {"model": "tiny", "max_tokens": 3, **FUZZ_BASES[path]}
        for _ in range(rng.randint(1, 3)):
            body[rng.choice(FUZZ_FIELDS)] = rng.choice(FUZZ_VALUES)
        r = http.post(path, json=body)
        assert r.status_code < 500, (path, body, r.text)
        statuses.add(r.status_code)
    assert {200, 400} <= statuses
    server.wait_idle()
