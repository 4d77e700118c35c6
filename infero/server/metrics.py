"""Prometheus metrics for `GET /metrics`, in the text exposition format (0.0.4), written by hand.

Names follow vLLM's (`vllm:num_requests_running` ...) with the prefix `infero:`, so dashboards built for vLLM
work after a rename. Gauges and token counters come from the engine's stats; latencies are measured here from
each request's event times (arrival, each output), as vLLM derives them. Every update and the rendering run on
the event loop's thread, so nothing here needs a lock.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

from infero.engine.engine import EngineStats
from infero.engine.request import RequestOutput

PREFIX = "infero:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
FINISH_REASONS = ("stop", "length", "abort")

# vLLM's buckets for the same histograms.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)  # fmt: skip


class Histogram:
    def __init__(self, buckets: Sequence[float]):
        self.buckets = tuple(buckets)
        self.counts = [0] * len(self.buckets)  # per bucket, not cumulative; rendering accumulates
        self.sum, self.count = 0.0, 0

    def observe(self, value: float) -> None:
        self.sum += value
        self.count += 1
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
                break


class Metrics:
    """The server's counters and histograms, and their exposition with the engine's current stats."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.finished = dict.fromkeys(FINISH_REASONS, 0)

    def track(self) -> RequestTimer:
        """A timer for one engine request (all of its n choices), started now."""
        return RequestTimer(self)

    def render(self, stats: EngineStats | None) -> str:
        label = f'model_name="{_escape(self.model_name)}"'
        lines: list[str] = []

        def metric(name: str, kind: str, help_text: str, value: float) -> None:
            lines.extend([f"# HELP {PREFIX}{name} {help_text}", f"# TYPE {PREFIX}{name} {kind}",
                          f"{PREFIX}{name}{{{label}}} {_number(value)}"])  # fmt: skip

        if stats is not None:
            metric("num_requests_running", "gauge", "Sequences in the running batch.", stats.num_running)
            metric("num_requests_waiting", "gauge", "Sequences waiting to be scheduled.", stats.num_waiting)
            metric("kv_cache_usage_perc", "gauge", "Fraction of KV cache blocks in use (1 = full).", stats.kv_usage)
            metric("num_preemptions_total", "counter", "Preemptions of running sequences.", stats.num_preemptions)
            metric("prompt_tokens_total", "counter", "Prompt tokens admitted.", stats.prompt_tokens_total)
            metric("generation_tokens_total", "counter", "Tokens generated.", stats.generation_tokens_total)
            metric("prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache.",
                   stats.prefix_cache_queries)  # fmt: skip
            metric("prefix_cache_hits_total", "counter", "Prompt tokens found in the prefix cache.",
                   stats.prefix_cache_hits)  # fmt: skip
            metric("prefix_caching_enabled", "gauge", "1 when prompts look up the prefix cache; 0 when turned off "
                   "or for a hybrid model (a cached prefix lacks its recurrent state).",
                   stats.prefix_caching)  # fmt: skip
            if stats.num_state_slots:
                metric("state_slots_total", "gauge", "Recurrent-state slots of a hybrid model (--max-num-seqs).",
                       stats.num_state_slots)  # fmt: skip
                metric("state_slots_usage_perc", "gauge", "Fraction of recurrent-state slots in use (1 = full).",
                       stats.state_slots_used / stats.num_state_slots)  # fmt: skip
        name = f"{PREFIX}request_success_total"
        lines += [f"# HELP {name} Finished sequences by finish reason.", f"# TYPE {name} counter"]
        for reason, count in self.finished.items():
            lines.append(f'{name}{{{label},finished_reason="{reason}"}} {count}')
        for suffix, hist, help_text in (
            ("time_to_first_token_seconds", self.ttft, "Time from arrival to the first generated token."),
            ("inter_token_latency_seconds", self.itl, "Time between consecutive generated tokens."),
            ("e2e_request_latency_seconds", self.e2e, "Time from arrival to the last token."),
        ):
            lines += _histogram_lines(PREFIX + suffix, hist, help_text, label)
        return "\n".join(lines) + "\n"


class RequestTimer:
    """Turns one engine request's outputs into latency observations and finish counts."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics
        self.start = time.monotonic()
        self.last: dict[int, float] = {}  # choice index -> time of its latest output
        self.done: set[int] = set()

    def on_output(self, out: RequestOutput) -> None:
        t = time.monotonic()
        index = out.index
        previous = self.last.get(index)
        if previous is None:
            self.metrics.ttft.observe(t - self.start)
        elif out.new_token_ids:
            gap = (t - previous) / len(out.new_token_ids)
            for _ in out.new_token_ids:
                self.metrics.itl.observe(gap)
        self.last[index] = t
        if out.finished:
            self.done.add(index)
            self.metrics.e2e.observe(t - self.start)
            reason = out.finish_reason if out.finish_reason in self.metrics.finished else "abort"
            self.metrics.finished[reason] += 1

    def close(self, num_choices: int) -> None:
        """The request ended; choices that never finished were aborted (client gone, shutdown, error)."""
        self.metrics.finished["abort"] += num_choices - len(self.done)
        self.done = set(range(num_choices))


def _histogram_lines(name: str, hist: Histogram, help_text: str, label: str) -> list[str]:
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
    cumulative = 0
    for bound, count in zip(hist.buckets, hist.counts, strict=True):
        cumulative += count
        lines.append(f'{name}_bucket{{{label},le="{_number(bound)}"}} {cumulative}')
    lines.append(f'{name}_bucket{{{label},le="+Inf"}} {hist.count}')
    lines.append(f"{name}_sum{{{label}}} {_number(hist.sum)}")
    lines.append(f"{name}_count{{{label}}} {hist.count}")
    return lines


def _number(value: float) -> str:
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, int):
        return str(value)
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def _escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
