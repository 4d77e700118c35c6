"""GET /v1/models, /health, /metrics; POST /tokenize and /detokenize."""

import dataclasses
import logging
import re
import threading
import time

import pytest
from live_server import TINY_ENGINE

from infero.engine.engine import EngineStats
from infero.server.app import CorsSettings
from infero.server.metrics import Histogram
from infero.server.stats_log import StatsLine

HELLO = [{"role": "user", "content": "hello"}]
SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$")


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text format -> {name{labels}: value}; fails on any line that is not a comment or a sample."""
    samples, types = {}, {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            types[name] = kind
            continue
        if line.startswith("# HELP ") or not line:
            continue
        match = SAMPLE.match(line)
        assert match, f"not a sample line: {line!r}"
        name, labels, value = match.groups()
        family = re.sub(r"_(bucket|sum|count)$", "", name) if name not in types else name
        assert family in types, f"{name} has no TYPE line"
        samples[name + (labels or "")] = float(value)
    return samples


def test_models_lists_the_served_model(server):
    [model] = server.client().models.list().data
    assert model.id == "tiny" and model.object == "model" and model.owned_by == "infero"
    assert model.model_extra["max_model_len"] == 256


def test_health_says_ok(server):
    r = server.http().get("/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_tokenize_and_detokenize_round_trip(server, tiny_llm):
    http = server.http()
    r = http.post("/tokenize", json={"model": "tiny", "prompt": "hello world"}).json()
    assert r["tokens"] == tiny_llm.tokenizer.encode("hello world")
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] == 256
    assert http.post("/detokenize", json={"model": "tiny", "tokens": r["tokens"]}).json() == {"prompt": "hello world"}
    chat = http.post("/tokenize", json={"messages": HELLO, "return_token_strs": True}).json()
    assert chat["tokens"] == tiny_llm.encode_chat(HELLO)
    assert "".join(chat["token_strs"]) == tiny_llm.render_chat(HELLO)
    r = http.post("/tokenize", json={"messages": HELLO, "add_generation_prompt": False}).json()
    assert r["tokens"] == tiny_llm.encode_chat(HELLO, add_generation_prompt=False)
    assert http.post("/detokenize", json={"tokens": [5, -1]}).status_code == 400
    assert http.post("/tokenize", json={"prompt": "x", "messages": HELLO}).status_code == 400


def test_metrics_parse_and_count_what_was_served(server):
    http = server.http()
    before = parse_metrics(http.get("/metrics").text)
    label = '{model_name="tiny"}'
    server.client().chat.completions.create(model="tiny", messages=HELLO, max_tokens=5, n=2,
                                            extra_body={"ignore_eos": True})  # fmt: skip
    r = http.get("/metrics")
    assert r.headers["content-type"].startswith("text/plain")
    after = parse_metrics(r.text)
    assert after["infero:generation_tokens_total" + label] - before["infero:generation_tokens_total" + label] == 10
    assert after["infero:prompt_tokens_total" + label] > before["infero:prompt_tokens_total" + label]
    length = 'infero:request_success_total{model_name="tiny",finished_reason="length"}'
    assert after[length] - before[length] == 2
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert after[f"infero:{name}_count{label}"] - before[f"infero:{name}_count{label}"] == 2
        inf = f'infero:{name}_bucket{{model_name="tiny",le="+Inf"}}'
        assert after[inf] == after[f"infero:{name}_count{label}"]
    itl = "infero:inter_token_latency_seconds_count" + label
    assert after[itl] - before[itl] == 8
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "num_preemptions_total"):
        assert f"infero:{gauge}{label}" in after


def test_request_phase_metrics_split_each_choices_latency_as_vllm_does(fresh_server, tiny_llm):
    """vLLM's request_queue / prefill / decode / inference time histograms and the token and parameter ones: a
    choice's time to first token is its queue time plus its prefill, its end-to-end latency the queue time plus its
    inference, its inference the prefill plus its decode."""
    live = fresh_server()
    prompt = "hello world and the"
    live.http().post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 5, "n": 2,
                                             "ignore_eos": True})  # fmt: skip
    m = parse_metrics(live.http().get("/metrics").text)

    def hist(name: str) -> tuple[float, float]:
        return m[f'infero:{name}_count{{model_name="tiny"}}'], m[f'infero:{name}_sum{{model_name="tiny"}}']

    (nq, queue), (np_, prefill), (nd, decode), (ni, inference) = (
        hist(f"request_{phase}_time_seconds") for phase in ("queue", "prefill", "decode", "inference")
    )
    assert (nq, np_, nd, ni) == (1, 2, 2, 2) and queue >= 0 and decode > 0
    assert hist("time_to_first_token_seconds")[1] == pytest.approx(2 * queue + prefill, abs=1e-6)
    assert hist("e2e_request_latency_seconds")[1] == pytest.approx(2 * queue + inference, abs=1e-6)
    assert inference == pytest.approx(prefill + decode, abs=1e-6)
    assert hist("request_prompt_tokens") == (1, len(tiny_llm.tokenizer.encode(prompt)))
    assert hist("request_generation_tokens") == (2, 10)
    assert hist("request_params_n") == (1, 2) and hist("request_params_max_tokens") == (1, 5)


def test_histogram_buckets_are_cumulative_in_the_text():
    hist = Histogram((0.1, 1.0))
    for value in (0.05, 0.5, 0.7, 5.0):
        hist.observe(value)
    assert hist.counts == [1, 2] and hist.count == 4 and hist.sum == 6.25


def test_cors_answers_a_browsers_preflight_as_vllm_does(server, fresh_server):
    """vllm serve lets any origin's pages call the API unless --allowed-origins says otherwise."""
    preflight = {"Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}  # fmt: skip
    r = server.http().options("/v1/chat/completions", headers=preflight)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
    r = server.http().get("/v1/models", headers={"Origin": "http://localhost:3000"})
    assert r.headers["access-control-allow-origin"] == "*"
    only = fresh_server(cors=CorsSettings(["http://app.example"], ["POST"], ["content-type"], True))
    r = only.http().options("/v1/completions", headers={**preflight, "Origin": "http://app.example",
                                                        "Access-Control-Request-Headers": "content-type"})  # fmt: skip
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://app.example"
    assert r.headers["access-control-allow-credentials"] == "true"
    r = only.http().options("/v1/completions", headers=preflight)
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers


def test_docs_can_be_turned_off_and_logprobs_capped(fresh_server):
    live = fresh_server(docs=False, max_logprobs=2)
    http = live.http()
    assert http.get("/docs").status_code == 404 and http.get("/openapi.json").status_code == 404
    body = {"model": "tiny", "messages": HELLO, "max_tokens": 2, "logprobs": True}
    assert http.post("/v1/chat/completions", json={**body, "top_logprobs": 2}).status_code == 200
    r = http.post("/v1/chat/completions", json={**body, "top_logprobs": 3})
    assert r.status_code == 400 and "--max-logprobs 2" in r.json()["error"]["message"]
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2, "logprobs": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"


def test_a_model_served_under_several_names_answers_to_each_and_names_itself_by_the_first(fresh_server):
    live = fresh_server(name="qwen3", aliases=("gpt-4o", "default"))
    client = live.client()
    assert [m.id for m in client.models.list().data] == ["qwen3", "gpt-4o", "default"]
    assert client.models.retrieve("gpt-4o").id == "gpt-4o"
    answer = client.chat.completions.create(model="default", messages=HELLO, max_tokens=2)
    assert answer.model == "qwen3"
    r = live.http().post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 404 and "'qwen3' or 'gpt-4o' or 'default'" in r.json()["error"]["message"]


def test_enable_log_requests_logs_each_request_as_it_arrives_and_ends_without_its_text(fresh_server, caplog):
    live = fresh_server(log_requests=True)
    with caplog.at_level("INFO", logger="infero.server"):
        r = live.http().post("/v1/completions", json={"model": "tiny", "prompt": "hello secret", "max_tokens": 3,
                                                      "temperature": 0, "ignore_eos": True})  # fmt: skip
        live.wait_idle()
    rid = r.json()["id"]
    lines = [rec.getMessage() for rec in caplog.records if rid in rec.getMessage()]
    assert lines[0].startswith(f"received request {rid}: prompt tokens ") and "temperature=0" in lines[0]
    assert lines[1] == f"finished request {rid}: 3 tokens generated"
    assert not any("secret" in rec.getMessage() for rec in caplog.records)


def test_the_periodic_stats_line_reports_what_was_served_and_goes_quiet_when_idle(fresh_server, caplog):
    """vllm serve's stats line: throughput over the interval, the queue, KV and prefix cache use; at INFO while
    (and just after) tokens flow, then DEBUG."""
    live = fresh_server(log_stats_interval=0.3)
    with caplog.at_level("DEBUG", logger="infero.server"):
        live.http().post("/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 20,
                                                 "ignore_eos": True})  # fmt: skip
        time.sleep(1.5)
    lines = [(r.levelname, r.getMessage()) for r in caplog.records if "Avg prompt throughput" in r.getMessage()]
    busy = [text for level, text in lines if level == "INFO"]
    assert busy and re.search(r"Avg generation throughput: [1-9][0-9.]* tokens/s", busy[0]), lines
    assert "Running: " in busy[0] and "Waiting: 0 reqs" in busy[0] and "KV cache usage: " in busy[0]
    assert "Prefix cache hit rate: " in busy[0]
    assert lines[-1][0] == "DEBUG" and "Avg generation throughput: 0.0 tokens/s" in lines[-1][1]


def test_stats_lines_count_the_interval_between_two_looks():
    def stats(prompt, generation, queries, hits, running=0, preemptions=0):
        return EngineStats(num_running=running, num_waiting=0, kv_usage=0.25, num_preemptions=preemptions,
                           kv_capacity_tokens=1024, prompt_tokens_total=prompt, generation_tokens_total=generation,
                           prefix_cache_queries=queries, prefix_cache_hits=hits, kv_blocks_referenced=0,
                           kv_blocks_cached=0, prefix_caching=True, num_state_slots=0, state_slots_used=0)  # fmt: skip

    tracker = StatsLine(stats(100, 50, 100, 0), now=0.0)
    level, text = tracker.line(stats(300, 250, 300, 150, running=2, preemptions=1), now=10.0)
    assert level == logging.INFO
    assert text == ("Avg prompt throughput: 20.0 tokens/s, Avg generation throughput: 20.0 tokens/s, Running: 2 reqs, "
                    "Waiting: 0 reqs, KV cache usage: 25.0%, Prefix cache hit rate: 75.0%, Preemptions: 1")  # fmt: skip
    assert tracker.line(stats(300, 250, 300, 150, preemptions=1), now=20.0)[0] == logging.INFO  # just after
    assert tracker.line(stats(300, 250, 300, 150, preemptions=1), now=30.0)[0] == logging.DEBUG


def test_priority_needs_the_priority_policy_and_orders_requests_under_it(server, fresh_server):
    """vLLM's `priority`: a 400 that names the flag under fcfs (never silently ignored); under --scheduling-policy
    priority, with one sequence at a time, the urgent request queued behind a long one runs before the lax ones."""
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 2, "priority": 1}
    r = server.http().post("/v1/completions", json=body)
    assert r.status_code == 400 and "--scheduling-policy priority" in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == "priority"
    assert server.http().post("/v1/completions", json={**body, "priority": 0}).status_code == 200
    live = fresh_server(engine_config=dataclasses.replace(TINY_ENGINE, max_num_seqs=1, scheduling_policy="priority"),
                        step_delay=0.01)  # fmt: skip
    finished = []

    def send(name: str, priority: int, max_tokens: int) -> None:
        body = {"model": "tiny", "prompt": "hello", "max_tokens": max_tokens, "priority": priority, "ignore_eos": True}
        r = live.http().post("/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        finished.append(name)

    first = threading.Thread(target=send, args=("first", 0, 150))  # ~1.5 s of steps
    first.start()
    time.sleep(0.2)  # the first runs; the others queue behind it
    others = [threading.Thread(target=send, args=(name, priority, 2)) for name, priority in
              (("lax", 5), ("lax2", 5), ("urgent", -5))]  # fmt: skip
    for t in others:
        t.start()
        time.sleep(0.05)
    for t in [first, *others]:
        t.join()
    assert finished == ["first", "urgent", "lax", "lax2"]
