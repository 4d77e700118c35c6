"""A Qwen3.5 hybrid (Gated DeltaNet + attention) served (on the CPU in CI, on the GPU with INFERO_TEST_DEVICE=cuda):
streaming, n > 1, logprobs and chunked prefill as for dense models; /metrics shows its state slots and prefix caching
off; a crowd of clients that hang up leaves every KV block and state slot free."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import random
import tempfile
import time
from pathlib import Path

import httpx
import pytest
from live_server import TEST_DEVICE, TINY_ENGINE, start_server

from infero.llm import LLM
from infero.server.app import ServerSettings

QWEN35 = Path(__file__).parent.parent / "fixtures" / "models" / "tiny-qwen35.gguf"
HELLO = [{"role": "user", "content": "hello there, the quick brown fox"}]
GREEDY = dict(model="hybrid", messages=HELLO, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
PROMPT = [random.Random(0).randrange(3, 250) for _ in range(40)]


@functools.cache
def model_path() -> Path:
    """The converted fixture; on the GPU, whose attention takes heads of 64 and up (the fixture's are 32), the
    synthetic tiny hybrid."""
    if TEST_DEVICE == "cpu":
        return QWEN35
    from infero.checkpoint.synthetic import write_synthetic

    return write_synthetic("qwen35-tiny", "Q8_0", Path(tempfile.mkdtemp()) / "qwen35-tiny.gguf", seed=3)


def serve(engine_config=TINY_ENGINE, step_delay: float = 0.0):
    def load() -> LLM:
        llm = LLM(model_path(), device=TEST_DEVICE, engine_config=engine_config)
        if step_delay:  # the tiny model steps in a few milliseconds: too fast to hang up mid-stream
            step = llm.engine.step

            def slow_step():
                time.sleep(step_delay)
                return step()

            llm.engine.step = slow_step
        return llm

    return start_server(load, ServerSettings("hybrid"))


def metric(text: str, name: str) -> float:
    [line] = [line for line in text.splitlines() if line.startswith(f"infero:{name}{{")]
    return float(line.rsplit(" ", 1)[1])


def completion(prompt, **extra) -> dict:
    return {"model": "hybrid", "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True, **extra}


@pytest.fixture(scope="module")
def hybrid_server():
    live = serve()
    yield live
    live.stop()


def test_streamed_text_is_the_whole_responses_text(hybrid_server):
    client = hybrid_server.client()
    whole = client.chat.completions.create(**GREEDY)
    assert whole.usage.completion_tokens == 8
    stream = client.chat.completions.create(**GREEDY, stream=True)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert streamed == whole.choices[0].message.content
    hybrid_server.wait_idle()


def test_n_choices_with_logprobs(hybrid_server):
    client = hybrid_server.client()
    [single] = client.chat.completions.create(**GREEDY).choices
    r = client.chat.completions.create(**GREEDY, n=3, logprobs=True, top_logprobs=2)
    assert [c.message.content for c in r.choices] == [single.message.content] * 3
    for choice in r.choices:
        assert len(choice.logprobs.content) == 8
        for entry in choice.logprobs.content:  # greedy: the chosen token is the most probable
            assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob) and entry.logprob <= 0
    hybrid_server.wait_idle()


def test_a_prompt_prefilled_in_small_chunks_gives_the_same_greedy_text(hybrid_server):
    want = hybrid_server.client().chat.completions.create(**GREEDY).choices[0].message.content
    chunked = serve(dataclasses.replace(TINY_ENGINE, max_num_batched_tokens=3))
    try:
        assert chunked.client().chat.completions.create(**GREEDY).choices[0].message.content == want
    finally:
        chunked.stop()


def test_a_repeated_prompt_finds_no_cached_tokens_and_metrics_say_why(hybrid_server):
    http = hybrid_server.http()
    for _ in range(2):
        usage = http.post("/v1/completions", json=completion(PROMPT)).json()["usage"]
        assert usage["prompt_tokens_details"] == {"cached_tokens": 0}
    text = http.get("/metrics").text
    assert metric(text, "prefix_caching_enabled") == 0 and metric(text, "prefix_cache_hits_total") == 0
    assert metric(text, "state_slots_total") == TINY_ENGINE.max_num_seqs
    assert metric(text, "state_slots_usage_perc") == 0
    hybrid_server.wait_idle()


async def client_that_may_hang_up(client: httpx.AsyncClient, i: int, expected: str) -> int:
    rng = random.Random(i)
    if i % 2:
        body = {**completion(PROMPT, n=1 + i % 3 // 2, temperature=0.8, seed=i), "stream": True}
        hang_up_after = rng.choice([0, 1, 3, None])
        async with client.stream("POST", "/v1/completions", json=body) as r:
            lines = 0
            async for line in r.aiter_lines():
                lines += bool(line)
                if hang_up_after is not None and lines > hang_up_after:
                    return r.status_code  # leaving the block closes the connection mid-stream
        return r.status_code
    r = await client.post("/v1/completions", json=completion(PROMPT))
    assert r.json()["choices"][0]["text"] == expected  # whatever shared its slots before, the same greedy text
    return r.status_code


def test_sixty_four_clients_hanging_up_leave_every_block_and_state_slot_free():
    live = serve(dataclasses.replace(TINY_ENGINE, max_num_batched_tokens=64), step_delay=0.002)
    try:
        http = live.http()
        expected = http.post("/v1/completions", json=completion(PROMPT)).json()["choices"][0]["text"]

        async def crowd():
            limits = httpx.Limits(max_connections=128, max_keepalive_connections=0)
            async with httpx.AsyncClient(base_url=live.url, timeout=60, limits=limits) as client:
                return await asyncio.gather(*(client_that_may_hang_up(client, i, expected) for i in range(64)))

        assert set(asyncio.run(crowd())) == {200}
        live.wait_idle(timeout=10)
        stats = live.stats()
        assert stats.kv_blocks_referenced == 0 and stats.state_slots_used == 0 and stats.num_state_slots == 64
        [aborted] = [line for line in http.get("/metrics").text.splitlines() if 'finished_reason="abort"' in line]
        assert float(aborted.rsplit(" ", 1)[1]) > 0  # some clients did hang up mid-request
        assert http.post("/v1/completions", json=completion(PROMPT)).json()["choices"][0]["text"] == expected
    finally:
        live.stop()
