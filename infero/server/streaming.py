"""From engine outputs to what the client reads: the merged outputs of one HTTP request's engine requests, and
the server-sent-event streams of chat and text completions in OpenAI's chunk shapes.

A stream is `data: {json}\\n\\n` per chunk and `data: [DONE]\\n\\n` at the end. When the client goes away, the
response stops iterating, the generators below are closed, and closing an engine stream aborts its request,
which frees its KV blocks within one step.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from typing import Any

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from infero.engine.async_engine import EngineStoppedError
from infero.engine.request import RequestOutput, TokenLogprob
from infero.engine.sampling import SamplingParams
from infero.errors import InferoError, NonFiniteLogitsError
from infero.server import protocol
from infero.server.errors import APIError, from_infero_error, unavailable
from infero.server.metrics import Metrics
from infero.tokenizer import Tokenizer

log = logging.getLogger("infero.server")

DONE = b"data: [DONE]\n\n"


def sse(data: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


class SSEResponse(StreamingResponse):
    """A text/event-stream response that stops (and closes its generator) as soon as the client disconnects,
    whether the generator is waiting for the engine or the socket is waiting for the client."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None] | None = None):
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def watch() -> None:
                    await self.listen_for_disconnect(receive)
                    group.cancel_scope.cancel()

                group.start_soon(watch)
                try:
                    await self.stream_response(send)
                except OSError:
                    pass  # the client went away while we wrote
                group.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()
            if self.on_close is not None:
                self.on_close()


# ---- one HTTP request's engine requests ----------------------------------------------------------------------


class Generation:
    """k prompts x n choices through the engine, their outputs merged as they come.

    Choice i of prompt p is choice `p * n + i` of the response (OpenAI's order for a list of prompts).
    `release` is called once per prompt, at its first output or at `close()`: the server bounds its queue by the
    prompts that wait for their first token. Latencies are measured from construction (the request's arrival).
    """

    def __init__(self, engine, metrics: Metrics, request_id: str, prompts: list[list[int]], params: SamplingParams,
                 release: Callable[[], None], cache_salt: str | None = None, log_requests: bool = False,
                 priority: int = 0):  # fmt: skip
        """log_requests: a log line when the request arrives and one when it ends (--enable-log-requests);
        priority: vLLM's, under the priority scheduling policy."""
        self.engine, self.request_id, self.prompts, self.params = engine, request_id, prompts, params
        self.release, self.cache_salt, self.log_requests = release, cache_salt, log_requests
        self.priority = priority
        if log_requests:
            lengths = ", ".join(str(len(p)) for p in prompts)
            log.info("received request %s: prompt tokens %s, %s", request_id, lengths, _describe(params))
        self.num_generated = 0
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache, counted at each prompt's first output
        self._timers = [metrics.track(len(p), params.n, params.max_tokens) for p in prompts]
        self._started = [False] * len(prompts)
        self._closed = False

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.params.n

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    def usage(self, completion_tokens: int) -> dict:
        return protocol.usage(self.num_prompt_tokens, completion_tokens, self.num_cached_tokens)

    async def outputs(self) -> AsyncIterator[tuple[int, int, RequestOutput]]:
        """(choice index, prompt index, output) for every output, until every choice has finished."""
        n = self.params.n
        streams = [
            self.engine.generate(f"{self.request_id}-{i}", ids, self.params, self.cache_salt, self.priority)
            for i, ids in enumerate(self.prompts)
        ]
        try:
            async with aclosing(_merge(streams)) as merged:
                async for p, out in merged:
                    if not self._started[p]:
                        self._started[p] = True
                        self.num_cached_tokens += out.num_cached_tokens
                        self.release()
                    self._timers[p].on_output(out)
                    self.num_generated += len(out.new_token_ids)
                    if out.finish_reason == "abort":
                        raise unavailable("the request was aborted: the server is shutting down", "shutting_down")
                    yield p * n + out.index, p, out
        except EngineStoppedError as e:
            raise unavailable(str(e), "shutting_down") from e
        finally:
            self.close()

    def close(self) -> None:
        """Give back the queue places of prompts that never started; count unfinished choices as aborted."""
        if self._closed:
            return
        self._closed = True
        if self.log_requests:
            log.info("finished request %s: %d tokens generated", self.request_id, self.num_generated)
        for p, timer in enumerate(self._timers):
            timer.close(self.params.n)
            if not self._started[p]:
                self.release()


def _describe(params: SamplingParams) -> str:
    """A request's parameters for its log line: those that differ from SamplingParams' defaults."""
    default = SamplingParams()
    shown = {name: getattr(params, name) for name in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty",
             "presence_penalty", "frequency_penalty", "seed", "max_tokens", "min_tokens", "n", "stop",
             "stop_token_ids", "logprobs", "ignore_eos")}  # fmt: skip
    text = ", ".join(f"{name}={value!r}" for name, value in shown.items() if value != getattr(default, name))
    if params.structured is not None:
        text += f", structured output {params.structured.kind}"
    return f"params ({text})"


async def _merge(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(stream index, item) from several async iterators as items arrive; closing this closes them all."""
    if len(streams) == 1:
        stream = streams[0]
        try:
            async for item in stream:
                yield 0, item
        finally:
            await stream.aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(i: int, stream) -> None:
        try:
            async for item in stream:
                queue.put_nowait((i, item))
        except Exception as e:
            queue.put_nowait((i, e))
        finally:
            await stream.aclose()
        queue.put_nowait((i, end))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            i, item = await queue.get()
            if item is end:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()  # cancels each engine stream, whose closing aborts its request
        await asyncio.gather(*tasks, return_exceptions=True)


def error_event(e: BaseException) -> bytes:
    """What a stream sends when it fails after its 200: an OpenAI error object as one more event."""
    return sse({"error": error_object(e)})


def error_object(e: BaseException) -> dict[str, Any]:
    """OpenAI's error object for what went wrong in a stream (an unexpected error is logged, its text not sent)."""
    if isinstance(e, NonFiniteLogitsError):  # the model's fault, as a non-streamed request's 500 says
        e = from_infero_error(e)
    if isinstance(e, APIError):
        status, message, code = e.status, e.message, e.code
    elif isinstance(e, InferoError):
        status, message, code = 503, str(e), None
    else:
        log.error("internal error in a stream", exc_info=e)
        status, message, code = 500, "internal server error; the server logged the details", None
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return {"message": message, "type": kind, "param": None, "code": code}


# ---- chat -----------------------------------------------------------------------------------------------------


@dataclass
class OutputParsers:
    """What a chat choice's text holds besides content: reasoning (`<think>...</think>`) and tool calls, found by
    the parsers in reasoning.py and tool_parsers/ (None: not looked for). Whole text and streamed deltas give the
    same parts."""

    reasoning: Any = None  # infero.server.reasoning.ThinkReasoningParser
    tools: Any = None  # infero.server.tool_parsers.ToolParser
    starts_in_reasoning: bool = False  # the prompt opened the reasoning
    single_call: bool = False  # parallel_tool_calls false: the first call only, the later ones dropped

    def message(self, text: str) -> dict[str, Any]:
        """A finished choice's "content", and "reasoning_content" / "tool_calls" when there are any."""
        message: dict[str, Any] = {}
        content: str | None = text
        if self.reasoning is not None:
            parsed = self.reasoning.parse(text, self.starts_in_reasoning)
            content = parsed.content
            if parsed.reasoning_content is not None:
                message["reasoning_content"] = parsed.reasoning_content
        if self.tools is not None and content:
            message.update(self.tools.parse(content).to_openai())
            if self.single_call and "tool_calls" in message:
                message["tool_calls"] = message["tool_calls"][:1]
        else:
            message["content"] = content
        return message

    def stream(self) -> ChoiceStream:
        return ChoiceStream(self)


class ChoiceStream:
    """One streamed choice through the parsers: text deltas in, OpenAI `delta` objects out."""

    def __init__(self, parsers: OutputParsers):
        self._reasoning = None if parsers.reasoning is None else parsers.reasoning.streaming_parser(
            parsers.starts_in_reasoning
        )  # fmt: skip
        self._tools = None if parsers.tools is None else parsers.tools.streaming_parser()
        self._single_call = parsers.single_call

    @property
    def called_tools(self) -> bool:
        return self._tools is not None and self._tools.num_tool_calls > 0

    def feed(self, text: str, final: bool) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        content: str | None = text or None
        if self._reasoning is not None:
            parts = self._reasoning.feed(text)
            if final:
                rest = self._reasoning.finish()
                parts.reasoning_content = _join(parts.reasoning_content, rest.reasoning_content)
                parts.content = _join(parts.content, rest.content)
            if parts.reasoning_content:
                deltas.append({"reasoning_content": parts.reasoning_content})
            content = parts.content
        if self._tools is None:
            if content:
                deltas.append({"content": content})
            return deltas
        messages = self._tools.feed(content) if content else []
        if final:
            messages += self._tools.finish()
        if self._single_call:
            for m in messages:
                m.tool_calls = [call for call in m.tool_calls if call.index == 0]
        return deltas + [d for d in (m.to_openai() for m in messages) if d]


def _join(a: str | None, b: str | None) -> str | None:
    return (a or "") + (b or "") or None


@dataclass
class StreamContext:
    """What every chunk of one response carries, and how its tokens become text."""

    response_id: str
    created: int
    model: str
    fingerprint: str
    tokenizer: Tokenizer
    logprobs: bool
    include_usage: bool
    continuous_usage: bool  # vLLM's continuous_usage_stats: every chunk carries the usage so far


@dataclass
class ChatStreamContext(StreamContext):
    parsers: OutputParsers | None = None  # None: the text is all content
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs: the answer carries them, N alternatives each
    return_token_ids: bool = False  # vLLM's: prompt_token_ids beside the choices, each choice's token_ids
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:N"
    echo: str = ""  # vLLM's chat echo: the text every choice's content begins with
    choices: dict[int, ChoiceStream] = field(default_factory=dict)


async def chat_stream(gen: Generation, ctx: ChatStreamContext) -> AsyncIterator[bytes]:
    base = {"id": ctx.response_id, "object": "chat.completion.chunk", "created": ctx.created, "model": ctx.model,
            "system_fingerprint": ctx.fingerprint}  # fmt: skip

    def chunk(choice: dict, **extra) -> bytes:
        data = {**base, "choices": [choice], **extra}
        if ctx.include_usage:
            data["usage"] = gen.usage(gen.num_generated) if ctx.continuous_usage else None
        return sse(data)

    try:
        prompt = {"prompt_token_ids": list(gen.prompts[0])} if ctx.return_token_ids else {}
        for i in range(gen.num_choices):
            yield chunk({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None, "stop_reason": None}, **prompt)  # fmt: skip
        for i in range(gen.num_choices if ctx.echo else 0):
            yield chunk({"index": i, "delta": {"content": ctx.echo}, "logprobs": None, "finish_reason": None,
                         "stop_reason": None})  # fmt: skip
        async with aclosing(gen.outputs()) as outputs:
            async for index, _, out in outputs:
                for choice in chat_choice_deltas(index, out, ctx):
                    yield chunk(choice)
        if ctx.include_usage:
            yield sse({**base, "choices": [], "usage": gen.usage(gen.num_generated)})
    except (asyncio.CancelledError, GeneratorExit):
        raise
    except Exception as e:
        yield error_event(e)
    yield DONE


def chat_choice_deltas(index: int, out: RequestOutput, ctx: ChatStreamContext) -> list[dict]:
    """The chunks' choices for one output: its deltas (logprobs on the first), the finish reason on the last."""
    if ctx.parsers is None:
        deltas = [{"content": out.new_text}] if out.new_text else []
        called_tools = False
    else:
        stream = ctx.choices.setdefault(index, ctx.parsers.stream())
        deltas = stream.feed(out.new_text, out.finished)
        called_tools = stream.called_tools
    logprobs = None
    if ctx.logprobs and out.logprobs:
        logprobs = {"content": protocol.chat_logprobs(ctx.tokenizer, out.logprobs, ctx.tokens_as_ids)}
    token_ids = ctx.return_token_ids and out.new_token_ids
    if not deltas and (logprobs is not None or out.finished or token_ids):
        deltas = [{}]
    choices = [{"index": index, "delta": d, "logprobs": None, "finish_reason": None, "stop_reason": None}
               for d in deltas]  # fmt: skip
    if choices:
        choices[0]["logprobs"] = logprobs
        if ctx.return_token_ids:  # every token on the first delta of its output, as logprobs
            for i, choice in enumerate(choices):
                choice["token_ids"] = list(out.new_token_ids) if i == 0 else []
        if out.finished:
            choices[-1]["finish_reason"] = "tool_calls" if called_tools else out.finish_reason
            choices[-1]["stop_reason"] = out.stop_reason
    return choices


# ---- text completions -----------------------------------------------------------------------------------------


@dataclass
class CompletionStreamContext(StreamContext):
    echo_texts: list[str] | None  # per prompt, when echo is set
    score_only: bool  # echo with max_tokens 0: the one generated token is dropped
    num_logprobs: int | None = None  # the legacy logprobs' alternatives a token
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs: each choice carries them, N alternatives each
    return_token_ids: bool = False  # vLLM's: each choice's prompt_token_ids (first piece) and token_ids
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:N"
    offsets: dict[int, int] = field(default_factory=dict)


async def completion_stream(gen: Generation, ctx: CompletionStreamContext) -> AsyncIterator[bytes]:
    base = {"id": ctx.response_id, "object": "text_completion", "created": ctx.created, "model": ctx.model,
            "system_fingerprint": ctx.fingerprint}  # fmt: skip
    try:
        async with aclosing(gen.outputs()) as outputs:
            async for index, p, out in outputs:
                data = {**base, "choices": [completion_piece(index, p, out, gen, ctx)]}
                if ctx.include_usage:
                    so_far = 0 if ctx.score_only else gen.num_generated
                    data["usage"] = gen.usage(so_far) if ctx.continuous_usage else None
                yield sse(data)
        if ctx.include_usage:
            completion_tokens = 0 if ctx.score_only else gen.num_generated
            yield sse({**base, "choices": [], "usage": gen.usage(completion_tokens)})
    except (asyncio.CancelledError, GeneratorExit):
        raise
    except Exception as e:
        yield error_event(e)
    yield DONE


def completion_piece(
    index: int, p: int, out: RequestOutput, gen: Generation, ctx: CompletionStreamContext
) -> dict[str, Any]:
    """One output of one choice as a completion choice: its text (the prompt first, with echo), its legacy
    logprobs, and the finish reason on its last output. Non-streaming responses join these pieces."""
    first = index not in ctx.offsets
    text, token_ids, entries = "", [], []
    if first and ctx.echo_texts is not None:
        text = ctx.echo_texts[p]
        token_ids = list(gen.prompts[p])
        n = ctx.num_logprobs or 0  # the list may be wider, for prompt_logprobs
        entries = [e and replace(e, top=e.top[:n]) for e in out.prompt_logprobs or [None] * len(token_ids)]
    if not ctx.score_only:
        text += out.new_text
        token_ids += out.new_token_ids
        entries += out.logprobs or [None] * len(out.new_token_ids)
    logprobs = None
    if ctx.logprobs:
        logprobs = protocol.completion_logprobs(ctx.tokenizer, _pad(entries, token_ids), token_ids,
                                                ctx.offsets.get(index, 0), ctx.tokens_as_ids)  # fmt: skip
        ctx.offsets[index] = (
            logprobs["text_offset"][-1] + len(protocol.token_text(ctx.tokenizer, token_ids[-1])[0])
            if token_ids
            else ctx.offsets.get(index, 0)
        )
    else:
        ctx.offsets.setdefault(index, 0)
    finish = None
    if out.finished:
        finish = "length" if ctx.score_only else out.finish_reason
    piece = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish,
             "stop_reason": out.stop_reason if out.finished else None}  # fmt: skip
    if ctx.return_token_ids:
        piece["token_ids"] = [] if ctx.score_only else list(out.new_token_ids)
        if first:
            piece["prompt_token_ids"] = list(gen.prompts[p])
    if first and ctx.prompt_logprobs is not None:
        piece["prompt_logprobs"] = protocol.prompt_logprobs(ctx.tokenizer, out.prompt_logprobs or [],
                                                            ctx.prompt_logprobs)  # fmt: skip
    return piece


def _pad(entries: list[TokenLogprob | None], token_ids: list[int]) -> list[TokenLogprob | None]:
    return (entries + [None] * len(token_ids))[: len(token_ids)]
