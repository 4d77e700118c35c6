"""The serving log's periodic line, as vllm serve writes one: throughput over the last interval, the queue, the KV
cache's use and the prefix cache's hit rate. At INFO while tokens flow (and once more after they stop), at DEBUG
while the server idles, so an idle log stays quiet."""

from __future__ import annotations

import asyncio
import dataclasses
import logging

from infero.engine.engine import EngineStats

log = logging.getLogger("infero.server")

LOG_INTERVAL_S = 10.0  # vLLM's VLLM_LOG_STATS_INTERVAL


class StatsLine:
    """Turns successive engine stats into log lines of the interval between them."""

    def __init__(self, stats: EngineStats, now: float):
        self.last, self.at, self.was_busy = stats, now, False

    def line(self, stats: EngineStats, now: float) -> tuple[int, str]:
        """(level, text) for the interval since the previous call."""
        seconds = max(now - self.at, 1e-9)
        prompt = (stats.prompt_tokens_total - self.last.prompt_tokens_total) / seconds
        generation = (stats.generation_tokens_total - self.last.generation_tokens_total) / seconds
        queries = stats.prefix_cache_queries - self.last.prefix_cache_queries
        hits = stats.prefix_cache_hits - self.last.prefix_cache_hits
        text = (f"Avg prompt throughput: {prompt:.1f} tokens/s, Avg generation throughput: {generation:.1f} tokens/s, "
                f"Running: {stats.num_running} reqs, Waiting: {stats.num_waiting} reqs, "
                f"KV cache usage: {100 * stats.kv_usage:.1f}%")  # fmt: skip
        if stats.prefix_caching:
            text += f", Prefix cache hit rate: {100 * hits / queries if queries else 0.0:.1f}%"
        if stats.num_preemptions > self.last.num_preemptions:
            text += f", Preemptions: {stats.num_preemptions - self.last.num_preemptions}"
        busy = bool(prompt or generation or stats.num_running or stats.num_waiting)
        level = logging.INFO if busy or self.was_busy else logging.DEBUG
        self.last, self.at, self.was_busy = stats, now, busy
        return level, text


async def log_stats(stats, interval: float = LOG_INTERVAL_S) -> None:
    """Every `interval` seconds until cancelled, the line of the engine whose stats() `stats` returns (None until
    the model is loaded)."""
    loop = asyncio.get_running_loop()
    tracker = None
    while True:
        await asyncio.sleep(interval)
        current = stats()
        if current is None:
            continue
        if tracker is None:  # the engine started within the last interval: count from nothing
            start = dataclasses.replace(current, prompt_tokens_total=0, generation_tokens_total=0,
                                        prefix_cache_queries=0, prefix_cache_hits=0, num_preemptions=0)  # fmt: skip
            tracker = StatsLine(start, loop.time() - interval)
        level, text = tracker.line(current, loop.time())
        log.log(level, "%s", text)
