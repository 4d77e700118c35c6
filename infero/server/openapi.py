"""The OpenAPI description of the routes, served at /openapi.json and browsable at /docs.

The routes read their bodies themselves (a size limit, then strict pydantic validation), so FastAPI cannot see the
request models in their signatures; each route declares its body and answers here instead (`route_docs`), and
`install` puts the request models' schemas among the components. The answer models below describe the JSON the
routes build as dicts; tests validate real answers against them.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

SCHEMA_REF = "#/components/schemas/{model}"

ERROR_DESCRIPTIONS = {
    400: "The request is malformed or cannot run (a field out of range, a prompt over the context, ...)",
    401: "The server has an API key and the request did not send it as 'Authorization: Bearer KEY'",
    404: "No such model (or route)",
    413: "The body is larger than 32 MiB",
    503: "The model is loading, the server is stopping, or too many requests wait (retry after Retry-After)",
}


# ---- answers --------------------------------------------------------------------------------------------------


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every answer that is not a success, in OpenAI's shape."""

    error: ErrorDetail


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    parent: str | None
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class FunctionCallOut(BaseModel):
    name: str
    arguments: str  # a JSON object as text


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionCallOut


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class PromptLogprob(BaseModel):
    """vLLM's entry of a prompt token, or of one of its alternatives, keyed by token id."""

    logprob: float
    rank: int  # 1: the most likely token at that position
    decoded_token: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: dict[str, Any] | None
    finish_reason: Literal["stop", "length", "tool_calls", "abort"] | None
    stop_reason: str | int | None = None  # vLLM's: the stop string or stop token id that ended it
    token_ids: list[int] | None = None  # vLLM's, with return_token_ids: the tokens generated


class ChatCompletionResponse(BaseModel):
    """A chat completion; with "stream": true the same content arrives as `chat.completion.chunk` events."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None  # vLLM's, when the request asks
    prompt_token_ids: list[int] | None = None  # vLLM's, with return_token_ids


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: dict[str, int]
    output_tokens: int
    output_tokens_details: dict[str, int]
    total_tokens: int


class ResponseObject(BaseModel):
    """A response of the Responses API; with "stream": true, its events (response.created, ...output_text.delta,
    ..., response.completed) as server-sent events."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete", "in_progress"]
    model: str
    output: list[dict[str, Any]]  # message, reasoning and function_call items, in OpenAI's shapes
    incomplete_details: dict[str, str] | None
    parallel_tool_calls: bool
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    usage: ResponseUsage | None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: dict[str, Any] | None
    finish_reason: Literal["stop", "length", "abort"] | None
    stop_reason: str | int | None = None  # vLLM's: the stop string or stop token id that ended it
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None  # vLLM's, when the request asks
    prompt_token_ids: list[int] | None = None  # vLLM's, with return_token_ids
    token_ids: list[int] | None = None  # vLLM's, with return_token_ids: the tokens generated


class CompletionResponse(BaseModel):
    """A text completion; with "stream": true the same content arrives as `text_completion` events."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    system_fingerprint: str
    choices: list[CompletionChoice]
    usage: Usage


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None


class DetokenizeResponse(BaseModel):
    prompt: str


class HealthResponse(BaseModel):
    status: Literal["ok"]


class VersionResponse(BaseModel):
    version: str


# ---- routes ---------------------------------------------------------------------------------------------------


def route_docs(
    request: type[BaseModel] | None, answer: type[BaseModel] | None, errors: tuple[int, ...], stream: bool = False
) -> dict[str, Any]:
    """Keyword arguments for a route's decorator: its JSON body `request` (read by the route itself), its 200
    `answer` (also as server-sent events when `stream`), and its error statuses in OpenAI's error shape."""
    docs: dict[str, Any] = {"responses": {status: {"model": ErrorResponse, "description": ERROR_DESCRIPTIONS[status]}
                                          for status in errors}}  # fmt: skip
    if answer is not None:
        docs["response_model"] = answer
        docs["response_model_exclude_none"] = False
    if stream:
        events = 'With "stream": true, server-sent events `data: {chunk}`, then `data: [DONE]`'
        docs["responses"][200] = {"content": {"text/event-stream": {"schema": {"type": "string"}}},
                                  "description": events}  # fmt: skip
    if request is not None:
        docs["openapi_extra"] = {"requestBody": {"required": True, "content": {"application/json": {
            "schema": {"$ref": SCHEMA_REF.format(model=request.__name__)}}}}}  # fmt: skip
    return docs


def install(app: FastAPI, request_models: list[type[BaseModel]]) -> None:
    """Serve the description with `request_models` among its components and the API key as a bearer scheme,
    without FastAPI's 422 answers (a body that does not validate is a 400 here, in OpenAI's shape)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in request_models:
                model_schema = model.model_json_schema(ref_template=SCHEMA_REF, mode="validation")
                components.update(model_schema.pop("$defs", {}))
                components[model.__name__] = model_schema
            for name in ("HTTPValidationError", "ValidationError"):
                components.pop(name, None)
            schema["components"]["securitySchemes"] = {"apiKey": {"type": "http", "scheme": "bearer"}}
            for operations in schema.get("paths", {}).values():
                for operation in operations.values():
                    operation.get("responses", {}).pop("422", None)
                    if "401" in operation.get("responses", {}):  # the routes behind --api-key
                        operation["security"] = [{"apiKey": []}]
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
