"""Prefix caching through the API: usage.prompt_tokens_details.cached_tokens, the /metrics counters, cache_salt,
--no-enable-prefix-caching, and a crowd of clients sharing a prefix (some hanging up) leaving no block held."""

import argparse
import asyncio
import json
import random

import httpx
import pytest

from infero.engine.engine import EngineConfig
from infero.errors import InferoError
from infero.server.serve import add_arguments, engine_config

PREFIX = [random.Random(0).randrange(3, 250) for _ in range(70)]  # four full blocks of 16 tokens, then 6
CACHED = 64
CACHING = EngineConfig(max_num_seqs=64, max_num_batched_tokens=512, kv_cache_bytes=16 << 20, seed=0)


def completion(prompt, **extra) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True, **extra}


def metric(text: str, name: str) -> int:
    [line] = [line for line in text.splitlines() if line.startswith(f"infero:{name}{{")]
    return int(line.rsplit(" ", 1)[1])


def streamed_usage(http: httpx.Client, path: str, body: dict) -> dict:
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with http.stream("POST", path, json=body) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: {")]
    return json.loads(events[-1])["usage"]


def test_usage_reports_cached_prompt_tokens_and_metrics_count_them(fresh_server):
    live = fresh_server(CACHING)
    http = live.http()
    first = http.post("/v1/completions", json=completion(PREFIX + [5])).json()
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    second = http.post("/v1/completions", json=completion(PREFIX + [6])).json()
    assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": CACHED}
    assert streamed_usage(http, "/v1/completions", completion(PREFIX + [7]))["prompt_tokens_details"] == {
        "cached_tokens": CACHED
    }
    two = http.post("/v1/completions", json=completion([PREFIX + [8], PREFIX + [9]])).json()
    assert two["usage"]["prompt_tokens_details"] == {"cached_tokens": 2 * CACHED}
    text = http.get("/metrics").text
    assert metric(text, "prefix_cache_queries_total") == 5 * len(PREFIX + [5])
    assert metric(text, "prefix_cache_hits_total") == 4 * CACHED
    assert metric(text, "prefix_caching_enabled") == 1
    live.wait_idle()


def test_chat_usage_reports_cached_tokens_streamed_and_not(fresh_server):
    live = fresh_server(CACHING)
    http = live.http()
    words = " ".join(["hello world"] * 30)  # one token a word, so the rendered prompt spans several blocks
    body = {"model": "tiny", "messages": [{"role": "user", "content": words}], "max_tokens": 3, "temperature": 0}
    first = http.post("/v1/chat/completions", json=body).json()["usage"]
    again = http.post("/v1/chat/completions", json=body).json()["usage"]
    streamed = streamed_usage(http, "/v1/chat/completions", body)
    full_blocks = (first["prompt_tokens"] - 1) // 16 * 16
    assert first["prompt_tokens"] > 32 and first["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["prompt_tokens_details"]["cached_tokens"] == full_blocks
    assert streamed["prompt_tokens_details"]["cached_tokens"] == full_blocks
    live.wait_idle()


def test_cache_salt_isolates_requests(fresh_server):
    live = fresh_server(CACHING)
    http = live.http()

    def cached(**extra) -> int:
        r = http.post("/v1/completions", json=completion(PREFIX + [5], **extra))
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached(cache_salt="tenant-a") == 0
    assert cached(cache_salt="tenant-b") == 0 and cached() == 0
    assert cached(cache_salt="tenant-a") == CACHED and cached() == CACHED
    r = http.post("/v1/completions", json=completion(PREFIX, cache_salt=""))
    assert r.status_code == 400 and "cache_salt" in r.json()["error"]["message"]
    live.wait_idle()


def test_caching_off_reports_no_cached_tokens(fresh_server):
    live = fresh_server(EngineConfig(kv_cache_bytes=16 << 20, enable_prefix_caching=False))
    http = live.http()
    for _ in range(2):
        usage = http.post("/v1/completions", json=completion(PREFIX + [5])).json()["usage"]
        assert usage["prompt_tokens_details"] == {"cached_tokens": 0}
    text = http.get("/metrics").text
    assert metric(text, "prefix_cache_hits_total") == 0 and metric(text, "prefix_caching_enabled") == 0
    live.wait_idle()


def test_the_serve_flag_and_its_environment_variable_turn_caching_off(monkeypatch):
    monkeypatch.delenv("INFERO_ENABLE_PREFIX_CACHING", raising=False)

    def config(argv):
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        return engine_config(parser.parse_args(argv))

    assert config([]).enable_prefix_caching and config(["--enable-prefix-caching"]).enable_prefix_caching
    assert not config(["--no-enable-prefix-caching"]).enable_prefix_caching
    monkeypatch.setenv("INFERO_ENABLE_PREFIX_CACHING", "off")
    assert not config([]).enable_prefix_caching and config(["--enable-prefix-caching"]).enable_prefix_caching
    monkeypatch.setenv("INFERO_ENABLE_PREFIX_CACHING", "maybe")
    with pytest.raises(InferoError, match="INFERO_ENABLE_PREFIX_CACHING"):
        config([])


async def shared_prefix_client(client: httpx.AsyncClient, i: int, expected: dict) -> int:
    """One of the crowd: a streamed request over the shared prefix that may hang up early, or a whole one whose
    text must be the reference's."""
    rng = random.Random(i)
    suffix = [5 + i % 3]
    if i % 2:
        body = {**completion(PREFIX + suffix, max_tokens=20, n=1 + i % 3 // 2), "stream": True}
        hang_up_after = rng.choice([0, 1, 3, None])
        async with client.stream("POST", "/v1/completions", json=body) as r:
            lines = 0
            async for line in r.aiter_lines():
                lines += bool(line)
                if hang_up_after is not None and lines > hang_up_after:
                    return r.status_code  # leaving the block closes the connection mid-stream
        return r.status_code
    r = await client.post("/v1/completions", json=completion(PREFIX + suffix, max_tokens=20))
    assert r.json()["choices"][0]["text"] == expected[suffix[0]]
    return r.status_code


def test_sixty_four_clients_sharing_a_prefix_leave_no_block_referenced(fresh_server):
    # Too few blocks for 64 prompts of 5 blocks each: the crowd shares, preempts and evicts.
    config = EngineConfig(max_num_seqs=64, kv_cache_bytes=2 << 20, max_num_batched_tokens=256, async_scheduling=True)
    live = fresh_server(config, step_delay=0.002)
    http = live.http()
    expected = {s: http.post("/v1/completions", json=completion(PREFIX + [s], max_tokens=20)).json() for s in (5, 6, 7)}
    expected = {s: r["choices"][0]["text"] for s, r in expected.items()}

    async def crowd():
        limits = httpx.Limits(max_connections=128, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=live.url, timeout=60, limits=limits) as client:
            return await asyncio.gather(*(shared_prefix_client(client, i, expected) for i in range(64)))

    assert set(asyncio.run(crowd())) == {200}
    live.wait_idle(timeout=5)
    stats = live.stats()
    assert stats.kv_blocks_referenced == 0 and stats.kv_usage == 0
    assert stats.kv_blocks_cached > 0 and stats.prefix_cache_hits > 0
    assert (
        http.post("/v1/completions", json=completion(PREFIX + [5], max_tokens=20)).json()["choices"][0]["text"]
        == expected[5]
    )
