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
# vLLM's 1-2-5 series for token counts (it stops at the model's context; these cover a million-token one)
TOKEN_BUCKETS = tuple(m * 10**e for e in range(7) for m in (1, 2, 5))
N_BUCKETS = (1, 2, 5, 10, 20)


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
        # a request's phases, as vLLM splits them: waiting until it first runs, its prompt until the first token,
        # the rest of its tokens, and both together
        self.queue, self.prefill = Histogram(E2E_BUCKETS), Histogram(E2E_BUCKETS)
        self.decode, self.inference = Histogram(E2E_BUCKETS), Histogram(E2E_BUCKETS)
        self.prompt_tokens, self.generation_tokens = Histogram(TOKEN_BUCKETS), Histogram(TOKEN_BUCKETS)
        self.params_n, self.params_max_tokens = Histogram(N_BUCKETS), Histogram(TOKEN_BUCKETS)
        self.finished = dict.fromkeys(FINISH_REASONS, 0)

    def track(self, prompt_tokens: int = 0, n: int = 1, max_tokens: int = 0) -> RequestTimer:
        """A timer for one engine request (all of its n choices), started now."""
        return RequestTimer(self, prompt_tokens, n, max_tokens)

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
            ("request_queue_time_seconds", self.queue, "Time from arrival until the request first runs."),
            ("request_prefill_time_seconds", self.prefill, "Time from first running to the first token."),
            ("request_decode_time_seconds", self.decode, "Time from the first token to the last."),
            ("request_inference_time_seconds", self.inference, "Time from first running to the last token."),
            ("request_prompt_tokens", self.prompt_tokens, "Prompt tokens of each request."),
            ("request_generation_tokens", self.generation_tokens, "Tokens generated for each finished choice."),
            ("request_params_n", self.params_n, "The n of each request."),
            ("request_params_max_tokens", self.params_max_tokens, "The max_tokens of each request."),
        ):
            lines += _histogram_lines(PREFIX + suffix, hist, help_text, label)
        return "\n".join(lines) + "\n"


class RequestTimer:
    """Turns one engine request's outputs into latency observations and finish counts."""

    def __init__(self, metrics: Metrics, prompt_tokens: int = 0, n: int = 1, max_tokens: int = 0):
        self.metrics, self.request = metrics, (prompt_tokens, n, max_tokens)
        self.start = time.monotonic()
        self.ran: float | None = None  # when the engine first ran the request (its clock is time.monotonic too)
        self.first: dict[int, float] = {}  # choice index -> time of its first token
        self.last: dict[int, float] = {}  # choice index -> time of its latest output
        self.generated: dict[int, int] = {}  # choice index -> tokens so far
        self.done: set[int] = set()
        self.closed = False

    def on_output(self, out: RequestOutput) -> None:
        t = time.monotonic()
        m, index = self.metrics, out.index
        if self.ran is None and out.first_scheduled is not None:
            self.ran = max(self.start, out.first_scheduled)
            m.queue.observe(self.ran - self.start)
        previous = self.last.get(index)
        if previous is None:
            m.ttft.observe(t - self.start)
            self.first[index] = t
        elif out.new_token_ids:
            gap = (t - previous) / len(out.new_token_ids)
            for _ in out.new_token_ids:
                m.itl.observe(gap)
        self.last[index] = t
        self.generated[index] = self.generated.get(index, 0) + len(out.new_token_ids)
        if out.finished:
            self.done.add(index)
            m.e2e.observe(t - self.start)
            reason = out.finish_reason if out.finish_reason in m.finished else "abort"
            m.finished[reason] += 1
            m.generation_tokens.observe(self.generated[index])
            m.decode.observe(t - self.first[index])
            if self.ran is not None:
                m.prefill.observe(self.first[index] - self.ran)
                m.inference.observe(t - self.ran)

    def close(self, num_choices: int) -> None:
        """The request ended; choices that never finished were aborted (client gone, shutdown, error)."""
        self.metrics.finished["abort"] += num_choices - len(self.done)
        self.done = set(range(num_choices))
        if not self.closed:
            self.closed = True
            prompt_tokens, n, max_tokens = self.request
            self.metrics.prompt_tokens.observe(prompt_tokens)
            self.metrics.params_n.observe(n)
            self.metrics.params_max_tokens.observe(max_tokens)


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
