"""`infero bench serve`: a closed-loop load generator for any OpenAI-compatible streaming endpoint.

N clients each send a streaming request, read its SSE stream to `data: [DONE]`, and send the next, until
`--duration` seconds have passed or `--requests` requests were sent; requests in flight then are awaited (for at most
`--timeout` seconds) and counted. It speaks raw HTTP/1.1 over `asyncio.open_connection` (keep-alive, chunked
transfer decoding, SSE parsing), so it adds no dependency and little client overhead, and runs against infero,
vLLM, llama-server or any peer.

Per request: TTFT (request written -> first content chunk), ITL (gaps between content chunks), TPOT ((last chunk
- first chunk) / (tokens - 1)), end-to-end latency; tokens come from the stream's `usage.completion_tokens`
(`stream_options.include_usage`). Requests ask for `temperature: 0` and `ignore_eos: true`; when the server honours
`ignore_eos`, an answer whose completion_tokens differs from `max_tokens` counts as an error. Prompts are synthetic,
about `--prompt-tokens` common English words (about one token each), different from the first word on for every
request so that prefix caches cannot help one server more than another. Where the server reports usage, the
warm-up rescales the word count until its prompt comes to within 15% of `--prompt-tokens` tokens (a synthetic
model's tokenizer splits a word into several tokens: 256 words were 1,100 tokens on `infero synth`'s).

Aggregates: generated tok/s and requests/s over the measured window (clients start -> last request done), and
mean/p50/p90/p99 of each latency. Latency statistics cover every request that streamed tokens.

`--shared-prefix N` puts the same N-token text before every request's own prompt: as a system message for chat, as
the prompt's first paragraph for completions. Warm-up requests size it by usage (the tokens it adds to a prompt) and
send it first, so the measured requests find it in a server's prefix cache, as a deployment's fixed system prompt
would be; where the server reports `usage.prompt_tokens_details.cached_tokens`, the report gives their mean.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import ssl
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from infero.errors import InferoError

CONNECT_TIMEOUT_S = 10.0
WARMUP_MAX_TOKENS = 8  # the first request (checks the endpoint, warms the server) asks for at most this many
MAX_BODY_BYTES = 16 << 20
USER_AGENT = "infero-bench-serve/0.1"

# Common English words, nearly all one token in every BPE vocabulary we meet (with their leading space).
_WORDS = (
    "the of and to in is was he for it with as his on be at by had are but from or have an they which one you "
    "were her all she there would their we him been has when who will more no if out so said what up its about "
    "into than them can only other new some could time these two may then do first any my now such like our over "
    "man me even most made after also did many before must through back years where much your way well down "
    "should because each just those people how too little state good very make world still own see men work long "
    "get here between both life being under never day same another know while last might us great old year off "
    "come since against go came right used take three states himself few house use during without again place "
    "american around however home small found thought went say part once general high upon school every "
    "does got united left number course war until always away something fact though water less public put think "
    "almost hand enough far took head yet government system better set told nothing night end why called didn "
    "eyes find going look asked later knew point next program city business give group toward young days let room"
).split()


# -- HTTP/1.1 and SSE ---------------------------------------------------------------------------------------------


class ProtocolError(Exception):
    """The peer did not speak HTTP/1.1, SSE or the OpenAI streaming format."""


class RequestError(Exception):
    """The server answered a request with an error (an HTTP status, or an error event in the stream)."""

    def __init__(self, status: int | None, message: str):
        super().__init__(f"HTTP {status}: {message}" if status is not None else message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class Target:
    """Where the endpoint is: scheme, host, port and the API's base path (ends in /v1)."""

    scheme: str
    host: str
    port: int
    base_path: str

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.host_header}{self.base_path}"

    @property
    def host_header(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        default = 443 if self.scheme == "https" else 80
        return host if self.port == default else f"{host}:{self.port}"


def parse_url(url: str) -> Target:
    """`http://host:port`, `http://host:port/v1` or a full endpoint URL -> Target with base path `.../v1`."""
    try:
        parts = urlsplit(url.strip())
        port = parts.port
    except ValueError as e:
        raise InferoError(f"--url {url!r} is not a URL: {e}") from e
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InferoError(f"--url {url!r} is not an http:// or https:// URL (for example http://127.0.0.1:8000)")
    path = parts.path.rstrip("/")
    for suffix in ("/chat/completions", "/completions", "/models"):
        if path.endswith(suffix):
            path = path[: -len(suffix)]
            break
    if not path.endswith("/v1"):
        path += "/v1"
    return Target(parts.scheme, parts.hostname, port or (443 if parts.scheme == "https" else 80), path)


class ChunkedDecoder:
    """Incremental `Transfer-Encoding: chunked` decoder: feed raw bytes, get body bytes; `done` after the last chunk."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._state = "size"
        self._left = 0
        self.done = False

    def feed(self, data: bytes) -> bytes:
        buf = self._buf
        buf += data
        out = bytearray()
        while not self.done:
            if self._state == "data":
                if not buf:
                    break
                n = min(self._left, len(buf))
                out += buf[:n]
                del buf[:n]
                self._left -= n
                if self._left == 0:
                    self._state = "crlf"
                continue
            i = buf.find(b"\n")
            if i < 0:
                if len(buf) > 4096:
                    raise ProtocolError("a chunk header longer than 4 KiB")
                break
            line = bytes(buf[:i]).rstrip(b"\r")
            del buf[: i + 1]
            if self._state == "size":
                try:
                    size = int(line.split(b";", 1)[0].strip(), 16)
                except ValueError:
                    raise ProtocolError(f"bad chunk size line {line[:40]!r}") from None
                if size < 0:
                    raise ProtocolError(f"bad chunk size line {line[:40]!r}")
                self._state, self._left = ("trailer", 0) if size == 0 else ("data", size)
            elif self._state == "crlf":
                if line:
                    raise ProtocolError("chunk data longer than its declared size")
                self._state = "size"
            elif not line:  # trailer section ends with an empty line
                self.done = True
        return bytes(out)


class SSEParser:
    """Incremental server-sent-events parser: feed body bytes, get the `data` of each complete event."""

    def __init__(self) -> None:
        self._buf = b""
        self._data: list[str] = []

    def feed(self, data: bytes) -> list[str]:
        *lines, self._buf = (self._buf + data).split(b"\n")
        events = []
        for line in lines:
            self._line(line, events)
        return events

    def close(self) -> list[str]:
        """Events left when the body ends without a final blank line."""
        events: list[str] = []
        if self._buf:
            self._line(self._buf, events)
            self._buf = b""
        self._line(b"", events)
        return events

    def _line(self, line: bytes, events: list[str]) -> None:
        if line.endswith(b"\r"):
            line = line[:-1]
        if not line:
            if self._data:
                events.append("\n".join(self._data))
                self._data = []
        elif line.startswith(b"data:"):
            value = line[6:] if line.startswith(b"data: ") else line[5:]
            try:
                self._data.append(value.decode("utf-8"))
            except UnicodeDecodeError:
                raise ProtocolError("an SSE data line that is not UTF-8") from None
        # comments (":..."), event:, id: and retry: lines carry nothing we measure


class Response:
    """Status and headers of an HTTP/1.1 response; the body is read with `pieces()` or `read_all()`."""

    def __init__(self, conn: Connection, status: int, headers: dict[str, str], keep_alive: bool, t_sent: float):
        self.conn = conn
        self.status = status
        self.headers = headers
        self.keep_alive = keep_alive
        self.t_sent = t_sent

    async def pieces(self) -> AsyncIterator[bytes]:
        """The body as it arrives (chunked transfer coding removed); the connection stays open only when reusable."""
        reader = self.conn.reader
        assert reader is not None
        if "chunked" in self.headers.get("transfer-encoding", "").lower():
            decoder = ChunkedDecoder()
            while not decoder.done:
                data = await reader.read(1 << 16)
                if not data:
                    raise ProtocolError("the connection closed in the middle of a chunked body")
                body = decoder.feed(data)
                if body:
                    yield body
        elif "content-length" in self.headers:
            try:
                left = int(self.headers["content-length"])
            except ValueError:
                raise ProtocolError(f"bad Content-Length {self.headers['content-length']!r}") from None
            while left > 0:
                data = await reader.read(min(left, 1 << 16))
                if not data:
                    raise ProtocolError("the connection closed before Content-Length bytes arrived")
                left -= len(data)
                yield data
        else:  # the body ends when the server closes the connection
            self.keep_alive = False
            while data := await reader.read(1 << 16):
                yield data
        if not self.keep_alive:
            self.conn.close()

    async def read_all(self, limit: int = MAX_BODY_BYTES) -> bytes:
        out = bytearray()
        async for piece in self.pieces():
            out += piece
            if len(out) > limit:
                self.conn.close()
                raise ProtocolError(f"a response body larger than {limit >> 20} MiB")
        return bytes(out)


class Connection:
    """One keep-alive HTTP/1.1 connection; reconnects when the server closed it, one request at a time."""

    def __init__(self, target: Target, headers: dict[str, str]):
        self.target = target
        self.headers = headers
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def connect(self) -> None:
        context = ssl.create_default_context() if self.target.scheme == "https" else None
        self.reader, self.writer = await asyncio.wait_for(
            asyncio.open_connection(self.target.host, self.target.port, ssl=context,
                                    server_hostname=self.target.host if context else None),
            CONNECT_TIMEOUT_S,
        )  # fmt: skip

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None

    async def request(self, method: str, path: str, body: bytes | None = None, accept: str = "*/*") -> Response:
        lines = [f"{method} {path} HTTP/1.1", f"Host: {self.target.host_header}", f"User-Agent: {USER_AGENT}",
                 f"Accept: {accept}", "Connection: keep-alive"]  # fmt: skip
        lines += [f"{k}: {v}" for k, v in self.headers.items()]
        if body is not None:
            lines += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
        raw = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (body or b"")
        for attempt in range(2):
            reused = self.writer is not None
            if not reused:
                await self.connect()
            assert self.reader is not None and self.writer is not None
            t_sent = time.perf_counter()
            try:
                self.writer.write(raw)
                await self.writer.drain()
                head = await self.reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError as e:
                self.close()
                if reused and attempt == 0 and not e.partial:
                    continue  # the server had closed the idle keep-alive connection: retry on a new one
                if e.partial:
                    raise ProtocolError(f"an incomplete HTTP response head {e.partial[:60]!r}") from None
                raise ConnectionResetError("the server closed the connection without answering") from None
            except asyncio.LimitOverrunError:
                self.close()
                raise ProtocolError("an HTTP response head larger than 64 KiB") from None
            except ConnectionError:
                self.close()
                if reused and attempt == 0:
                    continue
                raise
            return self._response(head, t_sent)
        raise AssertionError("unreachable")

    def _response(self, head: bytes, t_sent: float) -> Response:
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            self.close()
            raise ProtocolError(f"not an HTTP/1.x answer: {lines[0][:60]!r}")
        headers = {}
        for line in lines[1:]:
            if ":" in line:
                key, value = line.split(":", 1)
                headers[key.strip().lower()] = value.strip()
        keep_alive = parts[0] != "HTTP/1.0" and "close" not in headers.get("connection", "").lower()
        return Response(self, int(parts[1]), headers, keep_alive, t_sent)


def error_message(body: bytes) -> str:
    """The message of an OpenAI (or FastAPI, or plain text) error body, on one line."""
    text = body.decode("utf-8", "replace").strip()
    try:
        obj = json.loads(text)
    except ValueError:
        obj = None
    if isinstance(obj, dict):
        err = obj.get("error", obj.get("detail", obj.get("message")))
        if isinstance(err, dict):
            err = err.get("message", err)
        if err is not None:
            text = err if isinstance(err, str) else json.dumps(err)
    text = " ".join(text.split())
    return (text[:200] + "...") if len(text) > 200 else (text or "(empty body)")


# -- one request ----------------------------------------------------------------------------------------------------


@dataclass
class RequestRecord:
    """What one request measured; times are time.perf_counter() seconds."""

    index: int
    t_sent: float = 0.0
    t_first: float | None = None
    t_done: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    usage_completion: int | None = None
    usage_prompt: int | None = None
    usage_cached: int | None = None  # usage.prompt_tokens_details.cached_tokens, where the server sends it
    finish_reason: str | None = None
    completed: bool = False  # the stream ended with [DONE]
    error: str | None = None

    @property
    def tokens(self) -> int:
        return self.usage_completion if self.usage_completion is not None else len(self.chunk_times)


def _on_event(obj, rec: RequestRecord, now: float) -> None:
    if not isinstance(obj, dict):
        raise ProtocolError(f"an SSE event that is not a JSON object: {json.dumps(obj)[:80]}")
    if obj.get("error") is not None:
        raise RequestError(None, "error event in the stream: " + error_message(json.dumps(obj).encode()))
    usage = obj.get("usage")
    if isinstance(usage, dict):
        if isinstance(usage.get("completion_tokens"), int):
            rec.usage_completion = usage["completion_tokens"]
        if isinstance(usage.get("prompt_tokens"), int):
            rec.usage_prompt = usage["prompt_tokens"]
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            rec.usage_cached = details["cached_tokens"]
    choices = obj.get("choices")
    if not isinstance(choices, list):
        if isinstance(usage, dict):
            return
        raise ProtocolError(f"an SSE event without choices: {json.dumps(obj)[:80]}")
    content = False
    for choice in choices:
        if not isinstance(choice, dict):
            raise ProtocolError(f"a choice that is not a JSON object: {json.dumps(choice)[:80]}")
        delta = choice.get("delta")
        if isinstance(delta, dict):  # chat; reasoning models stream thinking in reasoning_content / reasoning
            content = content or any(delta.get(k) for k in ("content", "reasoning_content", "reasoning", "tool_calls"))
        else:  # completions
            content = content or bool(choice.get("text"))
        if choice.get("finish_reason"):
            rec.finish_reason = choice["finish_reason"]
    if content:
        rec.chunk_times.append(now)
        if rec.t_first is None:
            rec.t_first = now


async def stream_request(conn: Connection, path: str, payload: dict, rec: RequestRecord) -> None:
    """Send one streaming request and fill `rec` while its SSE stream arrives; raises on errors."""
    resp = await conn.request("POST", path, json.dumps(payload).encode(), accept="text/event-stream")
    rec.t_sent = resp.t_sent
    if resp.status != 200:
        raise RequestError(resp.status, error_message(await resp.read_all()))
    parser, events, done = SSEParser(), 0, False
    async for piece in resp.pieces():
        now = time.perf_counter()
        for data in parser.feed(piece):
            events += 1
            if done:
                continue
            if data.strip() == "[DONE]":
                done = True
                continue
            try:
                obj = json.loads(data)
            except ValueError:
                raise ProtocolError(f"an SSE event that is not JSON: {data[:80]!r}") from None
            _on_event(obj, rec, now)
    for data in parser.close():
        events += 1
        done = done or data.strip() == "[DONE]"
    if not done:
        if events == 0:
            kind = resp.headers.get("content-type", "no content-type")
            raise ProtocolError(f"the answer to a streaming request is not a server-sent event stream ({kind})")
        raise ProtocolError("the stream ended before `data: [DONE]`")
    rec.completed = True


# -- the benchmark --------------------------------------------------------------------------------------------------


@dataclass
class ServeBenchConfig:
    url: str
    clients: int = 1
    max_tokens: int = 200
    duration: float = 30.0
    requests: int | None = None
    api_key: str | None = None
    model: str | None = None
    prompt_tokens: int = 256
    endpoint: str = "chat"  # or "completions"
    timeout: float = 120.0
    seed: int = 0
    shared_prefix: int = 0  # tokens of one text every request starts with (0: none)


def make_prompt(seed: int, index: int, words: int) -> str:
    """A synthetic prompt of about `words` tokens, different for every (seed, index) from its first words on."""
    rng = random.Random(f"{seed}:{index}")
    return " ".join(rng.choices(_WORDS, k=max(1, words)))


def make_payload(cfg: ServeBenchConfig, model: str, prompt: str, max_tokens: int, ignore_eos: bool,
                 prefix: str | None = None) -> dict:  # fmt: skip
    payload: dict = {"model": model}
    if cfg.endpoint == "chat":
        system = [{"role": "system", "content": prefix}] if prefix else []
        payload["messages"] = [*system, {"role": "user", "content": prompt}]
    else:
        payload["prompt"] = f"{prefix}\n\n{prompt}" if prefix else prompt
    payload |= {"max_tokens": max_tokens, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    if ignore_eos:
        payload["ignore_eos"] = True
    return payload


def _endpoint_path(target: Target, endpoint: str) -> str:
    return target.base_path + ("/chat/completions" if endpoint == "chat" else "/completions")


def _user_error(target: Target, what: str, e: BaseException, api_key: str | None) -> InferoError:
    """Turn a failure of the first requests into the one line the CLI prints."""
    if isinstance(e, RequestError) and e.status in (401, 403):
        fix = "pass the right key with --api-key" if api_key else "it needs an API key: pass --api-key"
        return InferoError(f"{target.url} refused {what} with HTTP {e.status} ({e.message}); {fix}")
    if isinstance(e, RequestError) and e.status == 404:
        return InferoError(f"{what} at {target.url}: HTTP 404 ({e.message}); is this an OpenAI-compatible server, "
                           "with the --model and --endpoint you asked for?")  # fmt: skip
    if isinstance(e, RequestError):
        return InferoError(f"{what} at {target.url} failed: {e}")
    if isinstance(e, ProtocolError):
        return InferoError(f"{target.url} is not an OpenAI-compatible server: {e}")
    if isinstance(e, asyncio.TimeoutError | TimeoutError):
        return InferoError(f"{target.url} did not answer {what} in time")
    if isinstance(e, OSError):
        return InferoError(f"cannot connect to {target.url}: {e.strerror or e}")
    return InferoError(f"{what} at {target.url} failed: {type(e).__name__}: {e}")


async def fetch_model(conn: Connection, target: Target, api_key: str | None) -> str:
    """The first model id of `GET /v1/models`."""
    try:
        resp = await conn.request("GET", target.base_path + "/models", accept="application/json")
        body = await resp.read_all()
        if resp.status != 200:
            raise RequestError(resp.status, error_message(body))
    except Exception as e:
        conn.close()
        raise _user_error(target, "GET /models", e, api_key) from e
    try:
        models = json.loads(body)["data"]
        ids = [m["id"] for m in models]
    except (ValueError, KeyError, TypeError):
        raise InferoError(f"{target.url} is not an OpenAI-compatible server: GET /models did not answer with a "
                          f"model list ({body[:60]!r}); pass --model") from None  # fmt: skip
    if not ids or not isinstance(ids[0], str):
        raise InferoError(f"{target.url} lists no models; pass --model")
    return ids[0]


async def warm_up(
    conn: Connection, target: Target, cfg: ServeBenchConfig, model: str
) -> tuple[bool, bool, list[str], int]:
    """Short requests that check the endpoint, the key and the stream format, warm the server up and size the
    prompts.

    Returns whether the server takes `ignore_eos`, whether it reports usage, notes for the report, and the words
    per prompt that come to about cfg.prompt_tokens tokens (cfg.prompt_tokens where the server reports no usage)."""
    path, notes = _endpoint_path(target, cfg.endpoint), []
    max_tokens = min(cfg.max_tokens, WARMUP_MAX_TOKENS)
    ignore_eos, words, sizings, first = True, cfg.prompt_tokens, 0, None
    while True:
        rec = RequestRecord(-1)
        payload = make_payload(cfg, model, make_prompt(cfg.seed, -1, words), max_tokens, ignore_eos)
        try:
            await asyncio.wait_for(stream_request(conn, path, payload, rec), cfg.timeout)
        except RequestError as e:
            conn.close()
            if e.status == 400 and ignore_eos:
                ignore_eos = False  # a strict server (api.openai.com) rejects unknown fields: go without
                notes.append(f"the server rejected ignore_eos (HTTP 400: {e.message}); sent without it, so answers "
                             "may stop before --max-tokens (not counted as errors)")  # fmt: skip
                continue
            raise _user_error(target, f"POST {path.removeprefix(target.base_path)}", e, cfg.api_key) from e
        except Exception as e:
            conn.close()
            raise _user_error(target, f"POST {path.removeprefix(target.base_path)}", e, cfg.api_key) from e
        measured = rec.usage_prompt
        if measured is None or abs(measured - cfg.prompt_tokens) <= 0.15 * cfg.prompt_tokens or sizings == 3:
            break
        first = first or (words, measured)
        words, sizings = max(1, round(words * cfg.prompt_tokens / max(measured, 1))), sizings + 1
    if first is not None:
        notes.append(f"{first[0]} words made {first[1]:,} prompt tokens on this server: prompts are {words} words")
    if rec.usage_completion is None:
        notes.append("the server sent no usage (stream_options.include_usage): tokens are counted as content "
                     "chunks, and answers are not checked against --max-tokens")  # fmt: skip
    elif ignore_eos and rec.usage_completion != max_tokens:
        notes.append(f"the warm-up answer had {rec.usage_completion} of {max_tokens} tokens with ignore_eos: the "
                     "server may ignore the field")  # fmt: skip
    return ignore_eos, rec.usage_completion is not None, notes, words


async def send_shared_prefix(conn: Connection, target: Target, cfg: ServeBenchConfig, model: str, words: int,
                             ignore_eos: bool) -> tuple[str, str | None]:  # fmt: skip
    """The shared prefix, sent in warm-up requests so that the measured requests can find it cached, and a note on
    its size. Where the server reports usage, its words are rescaled (as warm_up does the prompts') until the
    prompt tokens it adds come to within 15% of cfg.shared_prefix."""
    path = _endpoint_path(target, cfg.endpoint)

    async def prompt_tokens(prefix: str | None) -> int | None:
        rec = RequestRecord(-1)
        payload = make_payload(cfg, model, make_prompt(cfg.seed, -3, words), WARMUP_MAX_TOKENS, ignore_eos, prefix)
        try:
            await asyncio.wait_for(stream_request(conn, path, payload, rec), cfg.timeout)
        except Exception as e:
            conn.close()
            what = f"POST {path.removeprefix(target.base_path)} (shared prefix)"
            raise _user_error(target, what, e, cfg.api_key) from e
        return rec.usage_prompt

    target_tokens, prefix_words = cfg.shared_prefix, cfg.shared_prefix
    without = await prompt_tokens(None)
    for sizing in range(4):
        prefix = make_prompt(cfg.seed, -2, prefix_words)
        with_prefix = await prompt_tokens(prefix)
        if without is None or with_prefix is None:
            return prefix, None
        added = with_prefix - without
        if abs(added - target_tokens) <= 0.15 * target_tokens or sizing == 3:
            break
        prefix_words = max(1, round(prefix_words * target_tokens / max(added, 1)))
    return prefix, f"the shared prefix is {prefix_words} words, {added:,} prompt tokens by usage"


class _Run:
    def __init__(self, cfg: ServeBenchConfig, target: Target, model: str, ignore_eos: bool, check_tokens: bool,
                 words: int, prefix: str | None):  # fmt: skip
        self.cfg, self.model, self.ignore_eos, self.check_tokens = cfg, model, ignore_eos, check_tokens
        self.words, self.prefix = words, prefix
        self.path = _endpoint_path(target, cfg.endpoint)
        self.records: list[RequestRecord] = []
        self.deadline = float("inf")

    def next_request(self) -> RequestRecord | None:
        if time.perf_counter() >= self.deadline:
            return None
        if self.cfg.requests is not None and len(self.records) >= self.cfg.requests:
            return None
        rec = RequestRecord(len(self.records))
        self.records.append(rec)
        return rec

    async def client(self, conn: Connection) -> None:
        cfg = self.cfg
        while (rec := self.next_request()) is not None:
            prompt = make_prompt(cfg.seed, rec.index, self.words)
            payload = make_payload(cfg, self.model, prompt, cfg.max_tokens, self.ignore_eos, self.prefix)
            try:
                await stream_request(conn, self.path, payload, rec)
                if self.check_tokens and rec.usage_completion != cfg.max_tokens:
                    rec.error = f"completion_tokens != max_tokens (finish_reason {rec.finish_reason})"
            except asyncio.CancelledError:
                rec.error = "still running when --timeout ran out"
                conn.close()
                raise
            except (RequestError, ProtocolError) as e:
                rec.error = str(e)
                conn.close()
            except (TimeoutError, OSError) as e:
                rec.error = f"connection: {type(e).__name__}: {e}"
                conn.close()
                await asyncio.sleep(0.05)  # a server that went away: do not spin
            except Exception as e:  # one request's surprise must not end the run
                rec.error = f"{type(e).__name__}: {e}"
                conn.close()
            finally:
                rec.t_done = time.perf_counter()
                if not rec.t_sent:
                    rec.t_sent = rec.t_done


async def run_bench(cfg: ServeBenchConfig, log: Callable[[str], None] | None = None) -> dict:
    """Run the load and return the summary (see `summarize`). Raises InferoError when the endpoint is unusable."""
    target = parse_url(cfg.url)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    conn = Connection(target, headers)
    try:
        model = cfg.model or await fetch_model(conn, target, cfg.api_key)
        if log:
            log(f"bench serve: {target.url} ({cfg.endpoint}), model {model}: warming up")
        ignore_eos, has_usage, notes, words = await warm_up(conn, target, cfg, model)
        prefix = None
        if cfg.shared_prefix:
            prefix, note = await send_shared_prefix(conn, target, cfg, model, words, ignore_eos)
            notes += [note] if note else []
    finally:
        conn.close()
    check_tokens = ignore_eos and has_usage
    run = _Run(cfg, target, model, ignore_eos, check_tokens, words, prefix)
    conns = [Connection(target, headers) for _ in range(cfg.clients)]
    await asyncio.gather(*(c.connect() for c in conns), return_exceptions=True)  # a failure reconnects later
    for c in conns:
        if c.writer is None:
            c.close()
    limit = f", at most {cfg.requests} requests" if cfg.requests is not None else ""
    if log:
        log(f"bench serve: {cfg.clients} clients for {cfg.duration:g} s{limit}, max_tokens {cfg.max_tokens}")
    t0 = time.perf_counter()
    run.deadline = t0 + cfg.duration
    tasks = [asyncio.create_task(run.client(c)) for c in conns]
    try:
        _, pending = await asyncio.wait(tasks, timeout=cfg.duration)
        if pending:
            _, pending = await asyncio.wait(pending, timeout=cfg.timeout)
        for t in pending:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        for t in tasks:
            t.cancel()
        for c in conns:
            c.close()
    t_end = max((r.t_done for r in run.records if r.t_done is not None), default=time.perf_counter())
    return summarize(cfg, target, model, ignore_eos, notes, run.records, t_end - t0)


# -- the report -----------------------------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None for no values."""
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _stats_ms(seconds: list[float]) -> dict:
    ms = [s * 1e3 for s in seconds]
    out = {"count": len(ms), "mean": sum(ms) / len(ms) if ms else None}
    out |= {f"p{q}": percentile(ms, q) for q in (50, 90, 99)}
    return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in out.items()}


def summarize(cfg: ServeBenchConfig, target: Target, model: str, ignore_eos: bool, notes: list[str],
              records: list[RequestRecord], window_s: float) -> dict:  # fmt: skip
    window_s = max(window_s, 1e-9)
    streamed = [r for r in records if r.t_first is not None]
    ttft = [r.t_first - r.t_sent for r in streamed]
    itl = [b - a for r in streamed for a, b in zip(r.chunk_times, r.chunk_times[1:], strict=False)]
    tpot = [(r.chunk_times[-1] - r.t_first) / (r.tokens - 1) for r in streamed if r.tokens > 1]
    e2e = [r.t_done - r.t_sent for r in records if r.completed and r.t_done is not None]
    ok = [r for r in records if r.error is None]
    tokens = sum(r.tokens for r in records)
    prompt_usage = [r.usage_prompt for r in records if r.usage_prompt is not None]
    cached_usage = [r.usage_cached for r in records if r.usage_cached is not None]
    errors = Counter(r.error for r in records if r.error is not None)
    return {
        "url": target.url,
        "endpoint": cfg.endpoint,
        "model": model,
        "clients": cfg.clients,
        "max_tokens": cfg.max_tokens,
        "prompt_tokens": cfg.prompt_tokens,
        "prompt_tokens_mean": sum(prompt_usage) / len(prompt_usage) if prompt_usage else None,
        "shared_prefix": cfg.shared_prefix,
        "cached_tokens_mean": sum(cached_usage) / len(cached_usage) if cached_usage else None,
        "ignore_eos": ignore_eos,
        "duration_s": round(window_s, 4),
        "requests": len(records),
        "requests_ok": len(ok),
        "errors": sum(errors.values()),
        "error_kinds": dict(errors.most_common()),
        "completion_tokens": tokens,
        "tok_s": round(tokens / window_s, 3),
        "req_s": round(len(ok) / window_s, 4),
        "ttft_ms": _stats_ms(ttft),
        "itl_ms": _stats_ms(itl),
        "tpot_ms": _stats_ms(tpot),
        "e2e_ms": _stats_ms(e2e),
        "notes": notes,
    }


def _ms(stats: dict) -> str:
    if not stats["count"]:
        return "n/a"
    return f"p50 {stats['p50']:,.2f} ms, p99 {stats['p99']:,.2f} ms (mean {stats['mean']:,.2f}, n={stats['count']:,})"


def format_table(r: dict) -> str:
    measured = f" (mean {r['prompt_tokens_mean']:,.0f} by usage)" if r["prompt_tokens_mean"] is not None else ""
    cached = f" (mean {r['cached_tokens_mean']:,.0f} cached by usage)" if r["cached_tokens_mean"] is not None else ""
    rows = [
        ("endpoint", f"{r['url']} ({r['endpoint']})"),
        ("model", r["model"]),
        ("clients", f"{r['clients']} (closed loop, streaming)"),
        ("prompt", f"~{r['prompt_tokens']} tokens{measured}"),
        ("max tokens", f"{r['max_tokens']}" + (" (ignore_eos)" if r["ignore_eos"] else "")),
        ("requests", f"{r['requests']:,} ({r['requests_ok']:,} ok, {r['errors']:,} errors) in {r['duration_s']:.2f} s"),
        ("generated", f"{r['completion_tokens']:,} tokens"),
        ("throughput", f"{r['tok_s']:,.1f} tok/s, {r['req_s']:,.2f} req/s"),
        ("TTFT", _ms(r["ttft_ms"])),
        ("ITL", _ms(r["itl_ms"])),
        ("TPOT", _ms(r["tpot_ms"])),
        ("end-to-end", _ms(r["e2e_ms"])),
    ]
    if r["shared_prefix"]:
        rows.insert(4, ("shared prefix", f"~{r['shared_prefix']} tokens before every prompt{cached}"))
    rows += [("error", f"{n:,} x {kind}") for kind, n in r["error_kinds"].items()]
    rows += [("note", note) for note in r["notes"]]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


# -- the command line -----------------------------------------------------------------------------------------------


def _positive(kind):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{text} is not positive")
        return value

    parse.__name__ = kind.__name__
    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `infero bench serve`."""
    parser.add_argument(
        "--url", required=True, help="the server, e.g. http://127.0.0.1:8000 (the /v1 API base is added when missing)"
    )
    parser.add_argument(
        "--clients",
        type=_positive(int),
        default=1,
        metavar="N",
        help="concurrent closed-loop streaming clients (default: 1)",
    )
    parser.add_argument(
        "--max-tokens", type=_positive(int), default=200, metavar="T", help="tokens per answer (default: 200)"
    )
    parser.add_argument(
        "--duration",
        type=_positive(float),
        default=30.0,
        metavar="S",
        help="stop sending after S seconds (default: 30)",
    )
    parser.add_argument(
        "--requests",
        type=_positive(int),
        metavar="R",
        help="stop after R requests in all, when that comes before --duration",
    )
    parser.add_argument("--api-key", metavar="K", help="sent as Authorization: Bearer K")
    parser.add_argument("--model", metavar="NAME", help="model name to ask for (default: the first of GET /v1/models)")
    parser.add_argument(
        "--prompt-tokens",
        type=_positive(int),
        default=256,
        metavar="P",
        help="prompt length in tokens, approximated by common words (default: 256)",
    )
    parser.add_argument(
        "--endpoint",
        choices=("chat", "completions"),
        default="chat",
        help="/v1/chat/completions or /v1/completions (default: chat)",
    )
    parser.add_argument(
        "--timeout",
        type=_positive(float),
        default=120.0,
        metavar="S",
        help="wait at most S seconds for the warm-up request, and for requests in flight at the end (default: 120)",
    )
    parser.add_argument(
        "--shared-prefix",
        type=_positive(int),
        default=0,
        metavar="N",
        help="start every prompt with the same N-token text, sent once before the run (default: 0, none)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the synthetic prompts (default: 0); runs of one seed send the same prompts, which a server "
        "with prefix caching answers from its cache the second time: give each run its own",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def config_from_args(args: argparse.Namespace) -> ServeBenchConfig:
    return ServeBenchConfig(url=args.url, clients=args.clients, max_tokens=args.max_tokens, duration=args.duration,
                            requests=args.requests, api_key=args.api_key, model=args.model,
                            prompt_tokens=args.prompt_tokens, endpoint=args.endpoint, timeout=args.timeout,
                            seed=args.seed, shared_prefix=args.shared_prefix)  # fmt: skip


def main(args: argparse.Namespace) -> int:
    """Run `infero bench serve`: the table (or JSON) on stdout, progress on stderr.

    Returns 0, or 1 when some requests failed (the report says which); an unusable endpoint raises InferoError."""
    result = asyncio.run(run_bench(config_from_args(args), log=lambda line: print(line, file=sys.stderr)))
    print(json.dumps(result, indent=2) if args.json else format_table(result))
    return 1 if result["errors"] else 0
