"""The HTTP face of the engine: an OpenAI-compatible FastAPI app.

    GET  /health                200 when the model is loaded, 503 while it loads or the server stops
    GET  /metrics               Prometheus text (open, like /health)
    GET  /version               {"version": ...}, as vLLM answers it (open)
    GET  /v1/models             the one served model; GET /v1/models/{id} its card (404 for another name)
    POST /v1/chat/completions   chat, streamed (SSE) or not
    POST /v1/completions        text completion: a string, token ids, or a list of either
    POST /tokenize, /detokenize vLLM's shapes
    GET  /openapi.json, /docs   the routes' description (openapi.py) and its Swagger page, open like /health

The model loads in a thread started by the app's lifespan, so the server answers (503) while it loads. Every
request body is read here with a size limit and validated strictly before anything runs; admission is bounded by
the number of requests waiting for their first token. The server never touches a tensor.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import hmac
import logging
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import pydantic
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.requests import ClientDisconnect

import infero
from infero.engine.async_engine import AsyncEngine
from infero.engine.engine import EngineStats
from infero.engine.sampling import MAX_LOGPROBS, SamplingParams
from infero.engine.structured import StructuredOutputError
from infero.errors import ChatTemplateError, InferoError, PromptTooLongError
from infero.server import metrics as metrics_module
from infero.server import openapi, protocol, responses, stats_log
from infero.server.errors import APIError, bad_request, from_validation_error, install_error_handlers, unavailable
from infero.server.reasoning import choose_reasoning_parser, get_reasoning_parser
from infero.server.streaming import (
    ChatStreamContext,
    CompletionStreamContext,
    Generation,
    OutputParsers,
    SSEResponse,
    chat_stream,
    completion_piece,
    completion_stream,
)
from infero.server.tool_parsers import choose_tool_parser, forced, get_tool_parser
from infero.tokenizer.tokenizer import TooManyTokensError

log = logging.getLogger("infero.server")

MAX_BODY_BYTES = 32 << 20
# A body over the limit is still read (and dropped) up to this size, so the client gets its 413 instead of a reset
# connection; beyond it we answer at once and close.
MAX_DRAIN_BYTES = 128 << 20
RESERVED_TEMPLATE_KWARGS = {"messages", "tools", "documents", "add_generation_prompt", "max_chars",
                            "continue_final_message"}  # fmt: skip

RequestModel = TypeVar("RequestModel", bound=pydantic.BaseModel)
REQUEST_MODELS = [protocol.ChatCompletionRequest, protocol.CompletionRequest, protocol.TokenizeRequest,
                  protocol.DetokenizeRequest, responses.ResponsesRequest]  # fmt: skip
# The error statuses of the API's routes: a bad body, no API key, an unknown model, too large, not ready.
POST_ERRORS = (400, 401, 404, 413, 503)


@dataclass
class CorsSettings:
    """Which browser pages may call the API (vllm serve's --allowed-origins ...; its defaults: any)."""

    allow_origins: list[str] = dataclasses.field(default_factory=lambda: ["*"])
    allow_methods: list[str] = dataclasses.field(default_factory=lambda: ["*"])
    allow_headers: list[str] = dataclasses.field(default_factory=lambda: ["*"])
    allow_credentials: bool = False


@dataclass
class ServerSettings:
    served_model_name: str
    api_key: str | None = None
    max_waiting_requests: int = 512
    max_body_bytes: int = MAX_BODY_BYTES
    shutdown_timeout: float = 30.0
    tool_call_parser: str | None = None  # None: the format the chat template teaches, if any
    reasoning_parser: str | None = None  # None: from the chat template
    max_logprobs: int = MAX_LOGPROBS  # the most alternatives a request may ask for a token (--max-logprobs)
    cors: CorsSettings = dataclasses.field(default_factory=CorsSettings)
    docs: bool = True  # /docs and /openapi.json (--disable-fastapi-docs turns them off)
    aliases: tuple[str, ...] = ()  # more names requests may use (vllm serve's --served-model-name A B ...)
    log_requests: bool = False  # a log line as each request arrives and ends (--enable-log-requests)
    default_chat_template_kwargs: dict[str, Any] | None = None  # under each request's (vLLM's flag of that name)
    return_tokens_as_token_ids: bool = False  # logprobs name tokens "token_id:N" unless a request says otherwise
    log_stats_interval: float | None = stats_log.LOG_INTERVAL_S  # the periodic stats line; None: none

    def tokens_as_ids(self, req: protocol.ChatCompletionRequest | protocol.CompletionRequest) -> bool:
        asked = req.return_tokens_as_token_ids
        return self.return_tokens_as_token_ids if asked is None else asked

    def template_kwargs(self, requested: dict[str, Any] | None) -> dict[str, Any]:
        """A request's chat template variables: the server's defaults with the request's own laid over them."""
        return {**(self.default_chat_template_kwargs or {}), **(requested or {})}

    @property
    def model_names(self) -> tuple[str, ...]:
        """Every name the model answers to; answers name it by the first."""
        return (self.served_model_name, *self.aliases)


class ServerState:
    """What the routes share: the settings, the loaded model (None while loading), metrics, the admission count."""

    def __init__(self, settings: ServerSettings):
        self.settings = settings
        self.metrics = metrics_module.Metrics(settings.served_model_name)
        self.llm: Any = None  # infero.llm.LLM once loaded
        self.engine: AsyncEngine | None = None
        self.status = "loading"  # loading | ready | failed | stopping
        self.load_error: BaseException | None = None
        self.num_queued = 0  # admitted prompts still waiting for their first output
        self.created = protocol.now()
        self.fingerprint = "fp_infero"
        self.reasoning_parser: Any = None  # from the chat template, when the model is loaded
        self.tool_parser: Any = None

    def engine_stats(self) -> EngineStats | None:
        return self.engine.stats() if self.engine is not None else None

    def begin_shutdown(self) -> None:
        """From now on new requests get 503; running ones go on until the engine's shutdown."""
        self.status = "stopping"

    def require_ready(self) -> AsyncEngine:
        if self.status == "ready" and self.engine is not None:
            return self.engine
        if self.status == "loading":
            raise unavailable("the model is still loading; retry shortly (GET /health says 200 when ready)", "loading")
        if self.status == "failed":
            raise APIError(503, f"the model failed to load: {self.load_error}", code="load_failed")
        raise unavailable("the server is shutting down", "shutting_down")

    def check_admissible(self, num_prompts: int) -> None:
        """A 400 for a request of more prompts than may ever wait at once: a 503 would have it retried forever."""
        limit = self.settings.max_waiting_requests
        if num_prompts > limit:
            raise bad_request(
                f"the request has {num_prompts} prompts and this server lets at most {limit} wait at once "
                f"(--max-waiting-requests {limit}), so it can never be admitted; send at most {limit} prompts a "
                "request", "prompt", "too_many_prompts",
            )  # fmt: skip

    def admit(self, num_prompts: int) -> Callable[[], None]:
        """Take `num_prompts` places in the waiting queue, or answer 503 while it is full (400 if it never could
        hold them); returns the release for one place."""
        engine = self.require_ready()
        self.check_admissible(num_prompts)
        waiting = max(self.num_queued, engine.stats().num_waiting)
        if waiting + num_prompts > self.settings.max_waiting_requests:
            raise unavailable(
                f"the server is overloaded: {waiting} requests are waiting "
                f"(--max-waiting-requests {self.settings.max_waiting_requests}); retry later",
                "queue_full",
            )
        self.num_queued += num_prompts

        def release() -> None:
            self.num_queued -= 1

        return release

    def loaded(self, llm) -> None:
        self.llm = llm
        digest = hashlib.sha256(f"{infero.__version__}:{llm.path.name}:{llm.config.name}".encode()).hexdigest()
        self.fingerprint = f"fp_{digest[:10]}"
        source = llm.chat_template.source if llm.chat_template is not None else None
        reasoning = self.settings.reasoning_parser or choose_reasoning_parser(source)
        tools = self.settings.tool_call_parser or choose_tool_parser(source)
        self.reasoning_parser = get_reasoning_parser(reasoning) if reasoning else None
        self.tool_parser = get_tool_parser(tools) if tools else None


def create_app(
    load: Callable[[], Any],
    settings: ServerSettings,
    on_ready: Callable[[Any], None] | None = None,
    on_load_error: Callable[[BaseException], None] | None = None,
) -> FastAPI:
    """The app. `load()` returns an `infero.LLM`; it runs in a thread once the app starts, and the engine starts
    when it returns; `on_ready(llm)` / `on_load_error(exc)` are then called on the event loop."""
    state = ServerState(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loading = asyncio.create_task(_load(state, load, on_ready, on_load_error))
        stats = None
        if settings.log_stats_interval is not None:
            stats = asyncio.create_task(stats_log.log_stats(state.engine_stats, settings.log_stats_interval))
        try:
            yield
        finally:
            state.begin_shutdown()
            if stats is not None:
                stats.cancel()
                await asyncio.gather(stats, return_exceptions=True)  # ended before the loop is
            if not loading.done():
                loading.cancel()
            if state.engine is not None:
                await state.engine.shutdown(settings.shutdown_timeout)

    app = FastAPI(title="infero", version=infero.__version__, lifespan=lifespan, redoc_url=None,
                  docs_url="/docs" if settings.docs else None,
                  openapi_url="/openapi.json" if settings.docs else None,
                  description="OpenAI's API, with vLLM's extensions")  # fmt: skip
    openapi.install(app, REQUEST_MODELS)
    app.state.infero = state
    install_error_handlers(app)
    cors = settings.cors  # outermost, so that every answer (an error's too) carries the CORS headers
    app.add_middleware(CORSMiddleware, allow_origins=cors.allow_origins, allow_methods=cors.allow_methods,
                       allow_headers=cors.allow_headers, allow_credentials=cors.allow_credentials)  # fmt: skip
    app.include_router(_open_routes(state))
    app.include_router(_api_routes(state), dependencies=[Depends(_auth_guard(state))])
    return app


async def _load(state: ServerState, load, on_ready, on_load_error) -> None:
    """Run `load` in a daemon thread (so a stop while loading does not wait for it), then start the engine."""
    loop = asyncio.get_running_loop()
    result: asyncio.Future = loop.create_future()

    def run() -> None:
        try:
            llm = load()
        except BaseException as e:  # noqa: BLE001 (reported to the loop, which decides)
            loop.call_soon_threadsafe(_settle, result, None, e)
        else:
            loop.call_soon_threadsafe(_settle, result, llm, None)

    threading.Thread(target=run, name="infero-load", daemon=True).start()
    try:
        llm = await result
        engine = AsyncEngine(llm.engine)
        await engine.start()
    except Exception as e:
        if state.status != "stopping":
            state.status, state.load_error = "failed", e
        if on_load_error is None or not isinstance(e, InferoError):  # a user's error is the callback's one line
            log.error("loading the model failed: %s", e, exc_info=not isinstance(e, InferoError))
        if on_load_error is not None:
            on_load_error(e)
        return
    state.loaded(llm)
    state.engine = engine
    if state.status == "loading":
        state.status = "ready"
    if on_ready is not None:
        on_ready(llm)


def _settle(future: asyncio.Future, value, error) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)


def _auth_guard(state: ServerState):
    expected = state.settings.api_key.encode() if state.settings.api_key else None

    async def guard(request: Request) -> None:
        if expected is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), expected):
            raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer KEY'", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})  # fmt: skip

    return guard


# ---- routes ---------------------------------------------------------------------------------------------------


def _open_routes(state: ServerState) -> APIRouter:
    router = APIRouter()

    @router.get("/health", **openapi.route_docs(None, openapi.HealthResponse, (503,)))
    async def health() -> JSONResponse:
        state.require_ready()
        return JSONResponse({"status": "ok"})

    @router.get("/version", **openapi.route_docs(None, openapi.VersionResponse, ()))
    async def version() -> JSONResponse:
        return JSONResponse({"version": infero.__version__})

    @router.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> Response:
        stats = state.engine.stats() if state.engine is not None else None
        return PlainTextResponse(state.metrics.render(stats), media_type=metrics_module.CONTENT_TYPE)

    return router


def _api_routes(state: ServerState) -> APIRouter:
    router = APIRouter()
    settings = state.settings

    def model_card(name: str) -> dict:
        engine = state.require_ready()
        return {"id": name, "object": "model", "created": state.created, "owned_by": "infero",
                "root": settings.served_model_name, "parent": None, "max_model_len": engine.max_model_len}  # fmt: skip

    @router.get("/v1/models", **openapi.route_docs(None, openapi.ModelList, (401, 503)))
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [model_card(name) for name in settings.model_names]})

    @router.get("/v1/models/{model_id:path}", **openapi.route_docs(None, openapi.ModelCard, (401, 404, 503)))
    async def model(model_id: str) -> JSONResponse:
        state.require_ready()
        protocol.check_model(model_id, settings.model_names)
        return JSONResponse(model_card(model_id))

    @router.post("/v1/chat/completions", **openapi.route_docs(protocol.ChatCompletionRequest,
                 openapi.ChatCompletionResponse, POST_ERRORS, stream=True))  # fmt: skip
    async def chat_completions(request: Request) -> Response:
        state.require_ready()
        req = await _parse(request, protocol.ChatCompletionRequest, settings.max_body_bytes)
        gen, ctx = await start_chat(req, protocol.new_id("chatcmpl"))
        return await _answer(request, gen, req.stream, lambda: chat_stream(gen, ctx), lambda: _collect_chat(gen, ctx))

    @router.post("/v1/responses", **openapi.route_docs(responses.ResponsesRequest, openapi.ResponseObject, POST_ERRORS,
                 stream=True))  # fmt: skip
    async def responses_route(request: Request) -> Response:
        """OpenAI's Responses API over the chat path (infero/server/responses.py)."""
        state.require_ready()
        req = await _parse(request, responses.ResponsesRequest, settings.max_body_bytes)
        try:
            chat = protocol.ChatCompletionRequest.model_validate(responses.to_chat(req))
        except pydantic.ValidationError as e:
            raise from_validation_error(e) from None
        gen, ctx = await start_chat(chat, responses.new_id())
        return await _answer(request, gen, req.stream, lambda: responses.stream(req, gen, ctx),
                             lambda: responses.collect(req, gen, ctx))  # fmt: skip

    async def start_chat(req: protocol.ChatCompletionRequest, response_id: str):
        """A chat request's generation, started, and the context its answer is written with."""
        protocol.check_model(req.model, settings.model_names)
        _check_logprobs(settings, req.num_logprobs, "top_logprobs")
        _check_logprobs(settings, req.prompt_logprobs, "prompt_logprobs")
        engine = state.require_ready()
        _check_priority(engine, req.priority)
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        messages = [m.to_template() for m in req.messages]
        prompt_ids, prompt_text = await asyncio.to_thread(
            _encode_chat, state, messages, tools, settings.template_kwargs(req.chat_template_kwargs),
            req.generation_prompt, False,
            req.continue_final_message, req.documents, _prompt_tokens_kept(engine, req.truncate_prompt_tokens),
        )  # fmt: skip
        max_tokens = _max_tokens(engine, prompt_ids, req.max_completion_tokens or req.max_tokens, "messages")
        params = protocol.sampling_params(
            req, vocab_size=_vocab_size(engine), max_tokens=max_tokens, logprobs=req.num_logprobs,
            prompt_logprobs=req.prompt_logprobs, defaults=state.llm.generation_defaults,
        )  # fmt: skip
        params, parsers = _forced_tool_calls(req, params) or (params, _output_parsers(state, req, prompt_text))
        await _validate(engine, prompt_ids, params, "messages", req.constraint_field)
        ctx = ChatStreamContext(
            response_id, protocol.now(), settings.served_model_name, state.fingerprint,
            engine.tokenizer, req.logprobs, req.include_usage, req.continuous_usage, parsers, req.prompt_logprobs,
            req.return_token_ids, settings.tokens_as_ids(req), req.echoed,
        )  # fmt: skip
        gen = Generation(engine, state.metrics, ctx.response_id, [prompt_ids], params, state.admit(1), req.cache_salt,
                         settings.log_requests, req.priority)  # fmt: skip
        return gen, ctx

    @router.post("/v1/completions", **openapi.route_docs(protocol.CompletionRequest, openapi.CompletionResponse,
                 POST_ERRORS, stream=True))  # fmt: skip
    async def completions(request: Request) -> Response:
        state.require_ready()
        req = await _parse(request, protocol.CompletionRequest, settings.max_body_bytes)
        protocol.check_model(req.model, settings.model_names)
        _check_logprobs(settings, req.logprobs, "logprobs")
        _check_logprobs(settings, req.prompt_logprobs, "prompt_logprobs")
        engine = state.require_ready()
        _check_priority(engine, req.priority)
        prompts = _prompt_list(req.prompt)
        state.check_admissible(len(prompts))  # before the work of encoding them
        keep = _prompt_tokens_kept(engine, req.truncate_prompt_tokens)
        prompts, texts = await asyncio.to_thread(_encode_prompts, engine, prompts, keep)
        # Only a max_tokens the client gave must fit; OpenAI's default of 16 may run to the context's end.
        requested = req.max_tokens if "max_tokens" in req.model_fields_set else None
        rooms = [_max_tokens(engine, ids, requested or None, "prompt") for ids in prompts]
        score_only = req.echo and req.max_tokens == 0
        max_tokens = 1 if score_only else req.max_tokens or min(rooms)
        # echo's legacy logprobs and vLLM's prompt_logprobs read one list, as wide as the wider asks
        asked = [n for n in (req.logprobs if req.echo else None, req.prompt_logprobs) if n is not None]
        prompt_logprobs = max(asked) if asked else None
        params = protocol.sampling_params(
            req, vocab_size=_vocab_size(engine), max_tokens=max_tokens, logprobs=req.logprobs,
            prompt_logprobs=prompt_logprobs, defaults=state.llm.generation_defaults,
        )  # fmt: skip
        for ids in prompts:
            await _validate(engine, ids, params, "prompt", req.constraint_field)
        ctx = CompletionStreamContext(
            protocol.new_id("cmpl"), protocol.now(), settings.served_model_name, state.fingerprint,
            engine.tokenizer, req.logprobs is not None, req.include_usage, req.continuous_usage,
            texts if req.echo else None, score_only, req.logprobs, req.prompt_logprobs, req.return_token_ids,
            settings.tokens_as_ids(req),
        )  # fmt: skip
        gen = Generation(engine, state.metrics, ctx.response_id, prompts, params, state.admit(len(prompts)),
                         req.cache_salt, settings.log_requests, req.priority)  # fmt: skip
        return await _answer(request, gen, req.stream, lambda: completion_stream(gen, ctx),
                             lambda: _collect_completion(gen, ctx))  # fmt: skip

    @router.post("/tokenize", **openapi.route_docs(protocol.TokenizeRequest, openapi.TokenizeResponse, POST_ERRORS))
    async def tokenize(request: Request) -> JSONResponse:
        state.require_ready()
        req = await _parse(request, protocol.TokenizeRequest, settings.max_body_bytes)
        protocol.check_model(req.model, settings.model_names)
        engine = state.require_ready()
        if req.messages is not None:
            tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
            messages = [m.to_template() for m in req.messages]
            special = bool(req.add_special_tokens)
            kwargs = settings.template_kwargs(req.chat_template_kwargs)
            ids, _ = await asyncio.to_thread(_encode_chat, state, messages, tools, kwargs, req.generation_prompt,
                                             special, req.continue_final_message)  # fmt: skip
        else:
            special = req.add_special_tokens is not False
            ids = await asyncio.to_thread(_encode_text, engine, req.prompt, special, "prompt")
        strs = [protocol.token_text(engine.tokenizer, i)[0] for i in ids] if req.return_token_strs else None
        return JSONResponse({"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids,
                             "token_strs": strs})  # fmt: skip

    @router.post("/detokenize", **openapi.route_docs(protocol.DetokenizeRequest, openapi.DetokenizeResponse,
                 POST_ERRORS))  # fmt: skip
    async def detokenize(request: Request) -> JSONResponse:
        state.require_ready()
        req = await _parse(request, protocol.DetokenizeRequest, settings.max_body_bytes)
        protocol.check_model(req.model, settings.model_names)
        engine = state.require_ready()
        _check_token_ids(engine, req.tokens, "tokens")
        return JSONResponse({"prompt": engine.tokenizer.decode(req.tokens)})

    return router


# ---- request bodies -------------------------------------------------------------------------------------------


async def _parse(request: Request, model: type[RequestModel], limit: int) -> RequestModel:
    body = await _read_body(request, limit)
    try:
        return model.model_validate_json(body, strict=True)
    except pydantic.ValidationError as e:
        raise from_validation_error(e) from None


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, or a 413 once it passes `limit` (by its Content-Length or by counting what arrives)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise bad_request(f"invalid Content-Length header {declared!r}")
        if int(declared) > limit:
            if int(declared) <= MAX_DRAIN_BYTES:
                await _drain(request)
            raise _too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            await _drain(request, size)
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


async def _drain(request: Request, size: int = 0) -> None:
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_DRAIN_BYTES:
            return


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than {limit // 2**20} MiB", code="request_too_large")


# ---- prompts --------------------------------------------------------------------------------------------------


def _encode_chat(state: ServerState, messages, tools, template_kwargs, add_generation_prompt, special,
                 continue_final_message=False, documents=None, keep=None):  # fmt: skip
    """The conversation rendered with the model's chat template, as (token ids, text); the template writes BOS."""
    template = state.llm.chat_template
    if template is None:
        raise ChatTemplateError(
            f"model {state.settings.served_model_name!r} has no chat template; restart the server with "
            "--chat-template FILE, or use /v1/completions"
        )
    reserved = RESERVED_TEMPLATE_KWARGS & set(template_kwargs)
    if reserved:
        raise bad_request(f"chat_template_kwargs may not set {', '.join(sorted(reserved))}", "chat_template_kwargs")
    engine = state.engine
    # The rendered prompt is refused once it is longer than any text of max_model_len tokens can be.
    max_bytes = engine.tokenizer.max_token_bytes
    max_chars = None if max_bytes is None or keep is not None else engine.max_model_len * max_bytes
    try:
        text = template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools, max_chars=max_chars,
                               continue_final_message=continue_final_message, documents=documents,
                               **template_kwargs)  # fmt: skip
    except PromptTooLongError:
        raise _too_long(engine, engine.max_model_len + 1, False, "messages") from None
    return _encode_text(engine, text, special, "messages", keep), text


def _encode_text(engine: AsyncEngine, text: str, special: bool, param: str, keep: int | None = None) -> list[int]:
    """The token ids of a prompt, or a 400 as soon as it is known to be longer than the context; `keep`: only its
    last `keep` tokens (vLLM's truncate_prompt_tokens), the whole text encoded first."""
    if keep is not None:
        return engine.tokenizer.encode(text, special)[-keep:]
    try:
        return engine.tokenizer.encode_bounded(text, engine.max_model_len, special)
    except TooManyTokensError as e:
        raise _too_long(engine, e.num_tokens, e.exact, param) from None


def _too_long(engine: AsyncEngine, num_tokens: int, exact: bool, param: str) -> APIError:
    count = num_tokens if exact else f"at least {num_tokens}"
    return bad_request(
        f"This model's maximum context length is {engine.max_model_len} tokens. However, your request has {count} "
        f"tokens in the {param}. Please reduce the length of the {param}.", param, "context_length_exceeded",
    )  # fmt: skip


def _prompt_list(prompt) -> list:
    """A completion's `prompt` as a list of prompts (a string, or a list of token ids, is one)."""
    return [prompt] if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else prompt


def _encode_prompts(engine: AsyncEngine, prompts: list, keep: int | None = None) -> tuple[list[list[int]], list[str]]:
    """A completion's prompts as token ids, with the text that `echo` repeats; `keep`: only each one's last `keep`
    tokens."""
    ids, texts = [], []
    for i, p in enumerate(prompts):
        param = f"prompt.{i}" if len(prompts) > 1 else "prompt"
        if isinstance(p, str):
            ids.append(_encode_text(engine, p, True, param, keep))
            texts.append(p if keep is None else engine.tokenizer.decode(ids[-1]))
            continue
        p = p if keep is None else p[-keep:]
        if len(p) > engine.max_model_len:  # refused before its text is decoded for echo
            raise _too_long(engine, len(p), True, param)
        _check_token_ids(engine, p, param)
        ids.append(list(p))
        texts.append(engine.tokenizer.decode(p))
    return ids, texts


def _prompt_tokens_kept(engine: AsyncEngine, truncate: int | None) -> int | None:
    """vLLM's truncate_prompt_tokens as the tokens a prompt keeps (-1: the context's length); None: all."""
    if truncate == 0 or (truncate is not None and truncate > engine.max_model_len):
        raise bad_request(f"truncate_prompt_tokens must be -1 or from 1 to the context's {engine.max_model_len} "
                          f"tokens; got {truncate}", "truncate_prompt_tokens")  # fmt: skip
    return engine.max_model_len if truncate == -1 else truncate


def _vocab_size(engine: AsyncEngine) -> int:
    return min(engine.model_config.vocab_size, engine.tokenizer.vocab_size)


def _check_logprobs(settings: ServerSettings, count: int | None, param: str) -> None:
    if count is not None and not 0 <= count <= settings.max_logprobs:
        asked = "the whole vocabulary's logprobs (-1)" if count < 0 else f"{count} logprobs a token"
        raise bad_request(f"{param}: requested {asked}, more than this server's --max-logprobs "
                          f"{settings.max_logprobs}", param)  # fmt: skip


def _check_priority(engine: AsyncEngine, priority: int) -> None:
    try:
        engine.check_priority(priority)
    except InferoError as e:
        raise bad_request(str(e), "priority") from e


def _check_token_ids(engine: AsyncEngine, ids: list[int], param: str) -> None:
    vocab = _vocab_size(engine)
    bad = next((i for i in ids if not 0 <= i < vocab), None)
    if bad is not None:
        raise bad_request(f"{param}: token id {bad} is outside the vocabulary [0, {vocab})", param)


def _max_tokens(engine: AsyncEngine, prompt_ids: list[int], requested: int | None, param: str) -> int:
    """The tokens a completion may generate: `requested`, or all the context leaves after the prompt when None; a
    400 context_length_exceeded with the numbers (in OpenAI's and vLLM's words) when they do not fit."""
    context, prompt = engine.max_model_len, len(prompt_ids)
    if requested is None and prompt >= context:
        raise bad_request(
            f"This model's maximum context length is {context} tokens. However, your request has {prompt} tokens in "
            f"the {param}, which leaves no room for a completion. Please reduce the length of the {param}.",
            param, "context_length_exceeded",
        )  # fmt: skip
    if requested is not None and prompt + requested > context:
        raise bad_request(
            f"This model's maximum context length is {context} tokens. However, you requested {prompt + requested} "
            f"tokens ({prompt} in the {param}, {requested} in the completion). Please reduce the length of the "
            f"{param} or completion.", param, "context_length_exceeded",
        )  # fmt: skip
    return context - prompt if requested is None else requested


async def _validate(engine: AsyncEngine, prompt_ids: list[int], params: SamplingParams, param: str,
                    constraint: str = "response_format") -> None:  # fmt: skip
    """The engine's own checks, as 400s; a grammar (the request's `constraint` field) compiles here, off the event
    loop."""
    try:
        if params.structured is None:
            engine.validate(prompt_ids, params)
        else:
            await asyncio.to_thread(engine.validate, prompt_ids, params)
    except PromptTooLongError as e:
        raise bad_request(str(e), param, "context_length_exceeded") from e
    except StructuredOutputError as e:
        raise bad_request(str(e), constraint) from e
    except InferoError as e:
        raise bad_request(str(e)) from e


# ---- reasoning and tool calls ----------------------------------------------------------------------------------


def _forced_tool_calls(req: protocol.ChatCompletionRequest, params: SamplingParams):
    """For tool_choice "required" or a named function: (params constrained to the call's JSON grammar, parsers
    that turn that JSON into tool calls); None otherwise. The grammar guarantees a well-formed call from any model,
    whether or not its template knows tools (as vLLM does)."""
    choice = req.tool_choice
    if not req.tools or choice in (None, "none", "auto"):
        return None
    if choice == "required":
        tools = [t.model_dump(exclude_none=True) for t in req.tools]
        spec, parser = forced.required_calls_schema(tools), forced.RequiredToolParser()
    else:
        name = choice.function.name
        tool = next(t for t in req.tools if t.function.name == name)
        spec, parser = forced.named_call_schema(tool.function.parameters), forced.NamedToolParser(name)
    if params.structured is not None:
        field = req.constraint_field
        raise bad_request(f"{field} cannot be combined with a forced tool_choice", field)
    return dataclasses.replace(params, structured=spec), OutputParsers(
        None, parser, False, req.parallel_tool_calls is False
    )


def _output_parsers(state: ServerState, req: protocol.ChatCompletionRequest, prompt: str) -> OutputParsers | None:
    """The parsers a chat choice's text goes through: reasoning when the model thinks in tags, tool calls when the
    request offers tools (and does not say tool_choice "none") and the template teaches a format we read."""
    reasoning = state.reasoning_parser
    offered = req.tools and req.tool_choice != "none" and state.tool_parser is not None
    tools = state.tool_parser.for_tools([t.model_dump(exclude_none=True) for t in req.tools]) if offered else None
    if reasoning is None and tools is None:
        return None
    starts = reasoning is not None and reasoning.prompt_opens_reasoning(prompt)
    return OutputParsers(reasoning, tools, starts, req.parallel_tool_calls is False)


# ---- non-streaming responses ----------------------------------------------------------------------------------


async def _answer(request: Request, gen: Generation, stream: bool, events, answer) -> Response:
    """The generation as server-sent `events()`, or as the JSON `answer()` collects; its engine requests end with
    the stream, or once the answer is collected or the client has gone."""
    if stream:
        return SSEResponse(events(), on_close=gen.close)
    try:
        return JSONResponse(await _until_disconnect(request, answer()))
    finally:
        gen.close()


async def _until_disconnect(request: Request, work) -> dict:
    """Run `work`; if the client disconnects first, cancel it (which aborts its engine requests)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if not task.done():
        await asyncio.gather(task, return_exceptions=True)
        raise ClientDisconnect()
    return task.result()


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _collect_chat(gen: Generation, ctx: ChatStreamContext) -> dict:
    n = gen.num_choices
    texts: list[list[str]] = [[] for _ in range(n)]
    token_ids: list[list[int]] = [[] for _ in range(n)]
    logprobs: list[list] = [[] for _ in range(n)]
    finish: list[str | None] = [None] * n
    stop_reasons: list[str | int | None] = [None] * n
    prompt_entries = None
    async with aclosing(gen.outputs()) as outputs:
        async for index, _, out in outputs:
            prompt_entries = prompt_entries or out.prompt_logprobs
            texts[index].append(out.new_text)
            token_ids[index] += out.new_token_ids
            logprobs[index] += out.logprobs or []
            if out.finished:
                finish[index], stop_reasons[index] = out.finish_reason, out.stop_reason
    choices = []
    for i in range(n):
        text = "".join(texts[i])
        message = {"role": "assistant", **(ctx.parsers.message(text) if ctx.parsers else {"content": text})}
        if ctx.echo:
            message["content"] = ctx.echo + (message.get("content") or "")
        choice = {"index": i, "message": message, "logprobs": None,
                  "finish_reason": "tool_calls" if message.get("tool_calls") else finish[i],
                  "stop_reason": stop_reasons[i]}  # fmt: skip
        if ctx.logprobs:
            choice["logprobs"] = {"content": protocol.chat_logprobs(ctx.tokenizer, logprobs[i], ctx.tokens_as_ids)}
        if ctx.return_token_ids:
            choice["token_ids"] = token_ids[i]
        choices.append(choice)
    response = {"id": ctx.response_id, "object": "chat.completion", "created": ctx.created, "model": ctx.model,
                "system_fingerprint": ctx.fingerprint, "choices": choices,
                "usage": gen.usage(gen.num_generated)}  # fmt: skip
    if ctx.return_token_ids:
        response["prompt_token_ids"] = list(gen.prompts[0])
    if ctx.prompt_logprobs is not None:  # vLLM's: one list for the conversation's prompt, beside the choices
        response["prompt_logprobs"] = protocol.prompt_logprobs(ctx.tokenizer, prompt_entries or [], ctx.prompt_logprobs)
    return response


async def _collect_completion(gen: Generation, ctx: CompletionStreamContext) -> dict:
    n = gen.num_choices
    pieces: list[list[dict]] = [[] for _ in range(n)]
    async with aclosing(gen.outputs()) as outputs:
        async for index, p, out in outputs:
            pieces[index].append(completion_piece(index, p, out, gen, ctx))
    choices = []
    for i in range(n):
        logprobs = None
        if ctx.logprobs:
            logprobs = {key: [v for piece in pieces[i] for v in piece["logprobs"][key]]
                        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}  # fmt: skip
        last = pieces[i][-1] if pieces[i] else {}
        text = "".join(piece["text"] for piece in pieces[i])
        choice = {"index": i, "text": text, "logprobs": logprobs, "finish_reason": last.get("finish_reason"),
                  "stop_reason": last.get("stop_reason")}  # fmt: skip
        first = pieces[i][0] if pieces[i] else {}  # a choice's prompt's lists come with its first piece
        if ctx.prompt_logprobs is not None:
            choice["prompt_logprobs"] = first.get("prompt_logprobs")
        if ctx.return_token_ids:
            choice["prompt_token_ids"] = first.get("prompt_token_ids")
            choice["token_ids"] = [t for piece in pieces[i] for t in piece["token_ids"]]
        choices.append(choice)
    completion_tokens = 0 if ctx.score_only else gen.num_generated
    return {"id": ctx.response_id, "object": "text_completion", "created": ctx.created, "model": ctx.model,
            "system_fingerprint": ctx.fingerprint, "choices": choices,
            "usage": gen.usage(completion_tokens)}  # fmt: skip
