"""`infero bench serve` against a fake OpenAI-compatible SSE server on 127.0.0.1 (in-process, its own thread)."""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import socket
import threading
import time

import pytest

from infero.bench import serve
from infero.bench.serve import ChunkedDecoder, ServeBenchConfig, SSEParser, parse_url, percentile, run_bench
from infero.errors import InferoError


class FakeServer:
    """A tiny keep-alive HTTP/1.1 server that streams `max_tokens - short_by` tokens, `token_delay` s apart."""

    def __init__(self):
        self.model = "fake-model"
        self.token_delay = 0.002
        self.short_by = 0  # answer this many tokens fewer than max_tokens
        self.api_key: str | None = None
        self.reject_ignore_eos = False  # answer 400 to requests with ignore_eos, as a strict server does
        self.send_usage = True
        self.tokens_per_word = 1  # prompt tokens the usage reports per word (a synthetic tokenizer: several)
        self.fail_every = 0  # answer every k-th completion request with HTTP 500
        self.html = False  # answer everything with an HTML page, as a web server that is not an API does
        self.framing = "chunked"  # or "close": Connection: close and a body that ends when the connection does
        self.silent_close = False  # close the connection after each answer without saying so beforehand
        self.requests: list[dict] = []  # the JSON bodies of completion requests, in arrival order
        self.paths: list[str] = []
        self.connections = 0
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self):
        self._thread.start()
        assert self._ready.wait(5)
        return self

    def __exit__(self, *exc):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)

    def _serve(self):
        asyncio.set_event_loop(self.loop)
        self.server = self.loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = self.server.sockets[0].getsockname()[1]
        self._ready.set()
        self.loop.run_forever()
        self.loop.run_until_complete(self._shutdown())
        self.loop.close()

    async def _shutdown(self):
        self.server.close()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _handle(self, reader, writer):
        self.connections += 1
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ")
                headers = {k.strip().lower(): v.strip() for k, v in (x.split(":", 1) for x in lines[1:] if x)}
                body = await reader.readexactly(int(headers.get("content-length", 0)))
                await self._respond(method, path, headers, body, writer)
                if self.silent_close or (self.framing == "close" and path.endswith("completions")):
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    @staticmethod
    async def _send(writer, status: str, body: bytes, content_type: str = "application/json"):
        head = f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n\r\n"
        writer.write(head.encode() + body)
        await writer.drain()

    async def _respond(self, method, path, headers, body, writer):
        self.paths.append(f"{method} {path}")
        if self.html:
            return await self._send(writer, "200 OK", b"<html><body>hello</body></html>", "text/html")
        if self.api_key is not None and headers.get("authorization") != f"Bearer {self.api_key}":
            err = {"error": {"message": "Incorrect API key provided", "type": "invalid_request_error"}}
            return await self._send(writer, "401 Unauthorized", json.dumps(err).encode())
        if method == "GET" and path == "/v1/models":
            models = {"object": "list", "data": [{"id": self.model, "object": "model"}, {"id": "other"}]}
            return await self._send(writer, "200 OK", json.dumps(models).encode())
        if method != "POST" or path not in ("/v1/chat/completions", "/v1/completions"):
            return await self._send(writer, "404 Not Found", b'{"detail":"Not Found"}')
        req = json.loads(body)
        self.requests.append(req)
        if self.reject_ignore_eos and "ignore_eos" in req:
            err = {"error": {"message": "Unrecognized request argument supplied: ignore_eos"}}
            return await self._send(writer, "400 Bad Request", json.dumps(err).encode())
        if self.fail_every and len(self.requests) % self.fail_every == 0:
            return await self._send(writer, "500 Internal Server Error", b'{"error":{"message":"boom"}}')
        await self._stream(writer, req, chat=path.endswith("/chat/completions"))

    async def _stream(self, writer, req, chat: bool):
        chunked = self.framing == "chunked"
        framing = "Transfer-Encoding: chunked" if chunked else "Connection: close"
        writer.write(f"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n{framing}\r\n\r\n".encode())

        async def event(data: str):
            payload = f"data: {data}\n\n".encode()
            writer.write(f"{len(payload):x}\r\n".encode() + payload + b"\r\n" if chunked else payload)
            await writer.drain()

        def chunk(text, finish=None):
            choice = {"index": 0, "finish_reason": finish}
            choice |= {"delta": {"content": text} if text else {}} if chat else {"text": text}
            return json.dumps({"id": "x", "object": "chunk", "model": req["model"], "choices": [choice]})

        if chat:
            await event(json.dumps({"choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]}))
        n = max(0, req["max_tokens"] - self.short_by)
        for i in range(n):
            await asyncio.sleep(self.token_delay)
            await event(chunk(f" w{i}"))
        await event(chunk("", "length" if n == req["max_tokens"] else "stop"))
        if self.send_usage and req.get("stream_options", {}).get("include_usage"):
            texts = [m["content"] for m in req["messages"]] if chat else [req["prompt"]]
            words = sum(len(t.split()) for t in texts)
            prompt_tokens = words * self.tokens_per_word
            usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}
            await event(json.dumps({"id": "x", "choices": [], "usage": usage}))
        await event("[DONE]")
        if chunked:
            writer.write(b"0\r\n\r\n")
            await writer.drain()


@pytest.fixture
def fake():
    with FakeServer() as server:
        yield server


def bench(fake, **kw) -> dict:
    cfg = ServeBenchConfig(**({"url": fake.url, "max_tokens": 16, "duration": 5.0, "prompt_tokens": 32} | kw))
    return asyncio.run(run_bench(cfg))


def run_main(capsys, *argv) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    code = serve.main(parser.parse_args(list(argv)))
    out, err = capsys.readouterr()
    return code, out, err


def sane(stats: dict, count: int | None = None, lo: float = 0.0, hi: float = 5000.0):
    assert stats["count"] > 0 if count is None else stats["count"] == count
    assert lo <= stats["p50"] <= stats["p90"] <= stats["p99"] <= hi, stats
    assert lo <= stats["mean"] <= hi, stats


# -- the pieces ---------------------------------------------------------------------------------------------------


def test_chunked_decoder_and_sse_parser_take_any_split():
    events = [
        b'data: {"a": 1}\n\n',
        b": keep-alive comment\n\n",
        b'data: {"b":\r\ndata: 2}\r\n\r\n',
        b"data: [DONE]\n\n",
    ]
    raw = b"".join(f"{len(e):x};ext=1\r\n".encode() + e + b"\r\n" for e in events) + b"0\r\nTrailer: x\r\n\r\n"
    for step in (1, 2, 3, 7, len(raw)):
        decoder, parser, got = ChunkedDecoder(), SSEParser(), []
        for i in range(0, len(raw), step):
            got += parser.feed(decoder.feed(raw[i : i + step]))
        assert decoder.done
        assert got == ['{"a": 1}', '{"b":\n2}', "[DONE]"]


def test_parse_url_and_percentile():
    assert parse_url("http://h:8000").base_path == "/v1"
    assert parse_url("http://h:8000/v1/").url == "http://h:8000/v1"
    assert parse_url("https://h/api/v1/chat/completions").url == "https://h/api/v1"
    with pytest.raises(InferoError, match="not an http"):
        parse_url("h:8000")
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0, 4.0], 50) == 2.5 and percentile([1.0, 2.0], 100) == 2.0


# -- against the fake server ----------------------------------------------------------------------------------------


def test_one_client_counts_tokens_and_latencies(fake):
    fake.token_delay = 0.003
    r = bench(fake, clients=1, requests=5)
    assert (r["requests"], r["requests_ok"], r["errors"]) == (5, 5, 0)
    assert r["completion_tokens"] == 5 * 16 and r["model"] == "fake-model" and r["ignore_eos"]
    assert len(fake.requests) == 1 + 5  # a warm-up request, then the measured ones
    assert fake.connections <= 3  # keep-alive: models + warm-up share one, the client reuses its own
    req = fake.requests[-1]
    assert req["model"] == "fake-model" and req["stream"] and req["temperature"] == 0 and req["ignore_eos"]
    assert req["max_tokens"] == 16 and req["stream_options"] == {"include_usage": True}
    sane(r["ttft_ms"], 5, lo=2.5, hi=500)
    sane(r["itl_ms"], 5 * 15, lo=0.0, hi=500)
    assert 2.5 <= r["itl_ms"]["p50"] <= 50  # about the fake's per-token sleep
    sane(r["tpot_ms"], 5, lo=2.5, hi=100)
    sane(r["e2e_ms"], 5, lo=16 * 2.5, hi=2000)
    assert r["e2e_ms"]["p50"] >= r["ttft_ms"]["p50"]
    assert r["tok_s"] == pytest.approx(r["completion_tokens"] / r["duration_s"], rel=1e-3)
    assert r["prompt_tokens_mean"] == 32


def test_four_clients_send_exactly_the_requested_number(fake):
    r = bench(fake, clients=4, requests=10, endpoint="completions")
    assert (r["requests"], r["requests_ok"], r["errors"], r["completion_tokens"]) == (10, 10, 0, 160)
    assert all("prompt" in q and "messages" not in q for q in fake.requests)
    assert all(p == "POST /v1/completions" for p in fake.paths[1:])
    sane(r["ttft_ms"], 10)
    sane(r["itl_ms"], 10 * 15)


def test_throughput_grows_with_clients(fake):
    fake.token_delay = 0.002
    one = bench(fake, clients=1, max_tokens=10, duration=0.8)
    four = bench(fake, clients=4, max_tokens=10, duration=0.8)
    assert one["errors"] == four["errors"] == 0
    assert four["requests"] > 2 * one["requests"]
    assert four["tok_s"] > 2.5 * one["tok_s"], (one["tok_s"], four["tok_s"])
    assert one["duration_s"] >= 0.8 and four["duration_s"] >= 0.8


@pytest.mark.parametrize("framing, silent_close", [("close", False), ("chunked", True)])
def test_connections_the_server_closes_are_reopened(fake, framing, silent_close):
    fake.framing, fake.silent_close = framing, silent_close
    r = bench(fake, clients=2, requests=6, max_tokens=8)
    assert (r["requests"], r["requests_ok"], r["errors"], r["completion_tokens"]) == (6, 6, 0, 48)
    assert fake.connections >= 6


def test_prompts_differ_per_request_and_have_about_the_asked_length(fake):
    bench(fake, clients=2, requests=6, prompt_tokens=50)
    prompts = [q["messages"][0]["content"] for q in fake.requests]
    assert len(set(prompts)) == len(prompts)
    assert len({tuple(p.split()[:3]) for p in prompts}) == len(prompts)  # they differ from the start
    assert all(len(p.split()) == 50 for p in prompts)


def test_prompts_are_resized_to_the_asked_tokens_where_words_make_several(fake):
    fake.tokens_per_word = 4  # 256 words were 1,100 tokens on infero synth's tokenizer
    r = bench(fake, clients=2, requests=4, prompt_tokens=200)
    assert all(len(q["messages"][0]["content"].split()) == 50 for q in fake.requests[-4:])
    assert r["prompt_tokens_mean"] == 200
    assert any("200 words made 800 prompt tokens" in n and "50 words" in n for n in r["notes"])


def test_a_shared_prefix_starts_every_request_and_is_sent_once_before_the_run(fake):
    r = bench(fake, clients=2, requests=4, prompt_tokens=20, shared_prefix=60)
    primed, *measured = fake.requests[-5:]
    system = primed["messages"][0]
    assert system["role"] == "system" and len(system["content"].split()) == 60
    assert all(q["messages"][0] == system and q["messages"][1]["role"] == "user" for q in measured)
    assert len({q["messages"][1]["content"] for q in measured}) == 4
    assert r["shared_prefix"] == 60 and r["requests_ok"] == 4
    bench(fake, requests=2, prompt_tokens=20, shared_prefix=30, endpoint="completions")
    prompts = [q["prompt"] for q in fake.requests[-3:]]
    head = prompts[0].split("\n\n")[0]
    assert len(head.split()) == 30 and all(p.startswith(head + "\n\n") for p in prompts)


def test_a_shared_prefix_is_sized_by_the_tokens_it_adds(fake):
    fake.tokens_per_word = 4
    r = bench(fake, requests=2, prompt_tokens=40, shared_prefix=400)
    assert len(fake.requests[-1]["messages"][0]["content"].split()) == 100
    assert "the shared prefix is 100 words, 400 prompt tokens by usage" in r["notes"]


def test_requests_in_flight_at_the_end_are_awaited_and_counted(fake):
    fake.token_delay = 0.025  # 10 tokens: about 0.25 s a request
    r = bench(fake, clients=3, max_tokens=10, duration=0.1)
    assert (r["requests"], r["requests_ok"], r["completion_tokens"]) == (3, 3, 30)
    assert r["duration_s"] >= 0.24


def test_requests_past_the_timeout_are_cut_and_reported(fake):
    fake.token_delay = 0.02  # the warm-up (8 tokens) takes 0.16 s; a 100-token request 2 s
    t = time.perf_counter()
    r = bench(fake, clients=2, max_tokens=100, duration=0.1, timeout=0.4)
    assert time.perf_counter() - t < 1.5
    assert r["requests"] == 2 and r["errors"] == 2 and r["requests_ok"] == 0
    assert r["error_kinds"] == {"still running when --timeout ran out": 2}
    assert r["duration_s"] == pytest.approx(0.5, abs=0.15)
    assert 0 < r["completion_tokens"] < 200  # the chunks that did arrive


def test_short_answers_are_errors(fake):
    fake.short_by = 3
    r = bench(fake, clients=2, requests=4)
    assert (r["requests"], r["requests_ok"], r["errors"]) == (4, 0, 4)
    assert r["completion_tokens"] == 4 * 13
    assert r["error_kinds"] == {"completion_tokens != max_tokens (finish_reason stop)": 4}


def test_server_errors_are_counted_and_the_exit_status_is_1(fake, capsys):
    fake.fail_every = 3  # the fake's 3rd, 6th and 9th completion requests fail: the warm-up is its 1st
    code, out, err = run_main(capsys, "--url", fake.url, "--clients", "2", "--requests", "8", "--max-tokens", "4",
                              "--json")  # fmt: skip
    r = json.loads(out)
    assert code == 1 and (r["requests"], r["requests_ok"], r["errors"]) == (8, 5, 3)
    assert r["error_kinds"] == {"HTTP 500: boom": 3}
    assert r["completion_tokens"] == 5 * 4
    assert "warming up" in err


def test_rejected_ignore_eos_is_retried_without_and_noted(fake):
    fake.reject_ignore_eos = True
    fake.short_by = 2  # without ignore_eos, short answers are expected and not errors
    r = bench(fake, clients=2, requests=4)
    assert not r["ignore_eos"] and r["errors"] == 0 and r["requests_ok"] == 4
    assert any("rejected ignore_eos" in n for n in r["notes"])
    assert all("ignore_eos" not in q for q in fake.requests[1:])


def test_missing_usage_falls_back_to_counting_chunks(fake):
    fake.send_usage = False
    r = bench(fake, clients=1, requests=3, max_tokens=12)
    assert r["errors"] == 0 and r["completion_tokens"] == 36 and r["prompt_tokens_mean"] is None
    assert any("no usage" in n for n in r["notes"])


def test_model_flag_skips_the_model_list(fake):
    bench(fake, clients=1, requests=2, model="mine")
    assert "GET /v1/models" not in fake.paths
    assert {q["model"] for q in fake.requests} == {"mine"}


def test_table_output(fake, capsys):
    code, out, err = run_main(capsys, "--url", fake.url + "/v1", "--clients", "2", "--requests", "4",
                              "--max-tokens", "8", "--api-key", "k")  # fmt: skip
    assert code == 0, err
    rows = dict(re.fullmatch(r"(.*?) {2,}(.*)", line).groups() for line in out.splitlines())
    assert rows["model"] == "fake-model" and rows["max tokens"] == "8 (ignore_eos)"
    assert "4 (4 ok, 0 errors)" in rows["requests"] and "32 tokens" in rows["generated"]
    for key in ("TTFT", "ITL", "TPOT", "throughput"):
        assert key in rows
    assert "p50" in rows["TTFT"] and "tok/s" in rows["throughput"]


# -- unusable endpoints: one clear InferoError (the CLI prints it and exits 2) ----------------------------------------


def test_wrong_api_key(fake, capsys):
    fake.api_key = "right"
    with pytest.raises(InferoError, match=r"HTTP 401 \(Incorrect API key provided\); pass the right key with --api"):
        run_main(capsys, "--url", fake.url, "--api-key", "wrong", "--requests", "1")
    with pytest.raises(InferoError, match="needs an API key"):
        bench(fake, model="fake-model", requests=1)  # straight to the completion request
    assert bench(fake, api_key="right", requests=1)["requests_ok"] == 1


def test_unreachable_url():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(InferoError, match=f"cannot connect to http://127.0.0.1:{port}/v1"):
        asyncio.run(run_bench(ServeBenchConfig(url=f"http://127.0.0.1:{port}", requests=1)))


def test_not_an_openai_server(fake):
    fake.html = True
    with pytest.raises(InferoError, match="not an OpenAI-compatible server: GET /models did not answer"):
        bench(fake, requests=1)
    with pytest.raises(InferoError, match="not an OpenAI-compatible server.*not a server-sent event stream.*text/html"):
        bench(fake, requests=1, model="m")
    fake.html = False
    with pytest.raises(InferoError, match="HTTP 404"):
        bench(fake, requests=1, url=fake.url + "/api")  # /api/v1/... does not exist


def test_not_http_at_all():
    async def main():
        async def babble(reader, writer):
            writer.write(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(babble, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            await run_bench(ServeBenchConfig(url=f"http://127.0.0.1:{port}", requests=1))
        finally:
            server.close()

    with pytest.raises(InferoError, match="not an OpenAI-compatible server: not an HTTP/1.x answer"):
        asyncio.run(main())
