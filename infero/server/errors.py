"""Every answer that is not a success, in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

Handlers turn what a route raises into that body with the right status: `APIError` as it says, the user errors
of the engine (`InferoError`) as 400, FastAPI's own 404/405 in our shape, and anything unexpected as a 500 whose
traceback goes to stderr while the server keeps serving. A client can never cause a 500 on purpose: whatever it
sends is checked before it reaches code that could fail on it.
"""

from __future__ import annotations

import json
import logging

import pydantic
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Receive, Scope, Send

from infero.errors import InferoError, NonFiniteLogitsError, PromptTooLongError

log = logging.getLogger("infero.server")

# OpenAI's `type` for each status (what api.openai.com answers; the SDK picks its exception by the status).
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    503: "server_error",
}


class APIError(Exception):
    """An HTTP error answer: status, a message that says what to do, and OpenAI's param and code."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None, headers=None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, param=self.param, code=self.code, headers=self.headers)


def error_response(
    status: int, message: str, *, param: str | None = None, code: str | None = None, headers=None
) -> JSONResponse:
    body = {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}  # fmt: skip
    return JSONResponse(body, status_code=status, headers=headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def unavailable(message: str, code: str) -> APIError:
    """503 with a Retry-After, so that clients (the OpenAI SDK among them) back off and try again."""
    return APIError(503, message, code=code, headers={"Retry-After": "1"})


def from_validation_error(e: pydantic.ValidationError) -> APIError:
    """A 400 naming the first field that is wrong (as `messages.0.content`), or saying the JSON is malformed."""
    errors = e.errors(include_url=False)
    first = errors[0]
    if first["type"] == "json_invalid":
        return bad_request(f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}")
    if first["type"] == "model_type" and not first["loc"]:
        return bad_request("the request body must be a JSON object")
    path, in_union = _field_path(first["loc"])
    param = ".".join(path) or None
    detail = first["msg"] + (", or another accepted form" if in_union else "")
    if first["type"] not in ("missing", "extra_forbidden") and "input" in first:
        detail += f" (got {_short(first['input'])})"
    others = {_field_path(error["loc"])[0] for error in errors[1:]} - {path}
    more = f" (and {len(others)} more problems)" if others else ""
    return bad_request(f"{param}: {detail}{more}" if param else detail + more, param=param)


def _field_path(loc: tuple) -> tuple[tuple[str, ...], bool]:
    """The field names and indexes of an error's location, without the member tags pydantic adds inside unions
    (`str`, `list[int]`, `NamedToolChoice`, `literal[...]`); and whether there were any."""
    path, in_union = [], False
    for part in loc:
        if isinstance(part, str) and ("[" in part or part in _TYPE_TAGS or part[:1].isupper()):
            in_union = True
        else:
            path.append(str(part))
    return tuple(path), in_union


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "function-after", "function-before"}


def from_infero_error(e: InferoError) -> APIError:
    if isinstance(e, PromptTooLongError):
        return bad_request(str(e), param="messages", code="context_length_exceeded")
    if isinstance(e, NonFiniteLogitsError):  # the model's fault, not the request's
        return APIError(500, str(e), code="non_finite_logits")
    return bad_request(str(e))


def _short(value, limit: int = 80) -> str:
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def install_error_handlers(app: FastAPI) -> None:
    """Route every error a request can end in to an OpenAI error body."""

    async def api_error(request: Request, e: APIError) -> JSONResponse:
        return e.response()

    async def infero_error(request: Request, e: InferoError) -> JSONResponse:
        return from_infero_error(e).response()

    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        messages = {404: f"no route {request.method} {request.url.path}", 405: f"{request.method} is not allowed here"}
        message = messages.get(e.status_code, str(e.detail))
        return error_response(e.status_code, message, code="not_found" if e.status_code == 404 else None)

    async def validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {"loc": (), "msg": "invalid request"}
        param = ".".join(str(part) for part in first["loc"][1:]) or None
        return error_response(400, f"{param}: {first['msg']}" if param else first["msg"], param=param)

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(InferoError, infero_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_middleware(CatchAllMiddleware)


class CatchAllMiddleware:
    """The last line: an exception no handler took becomes a 500 in OpenAI's shape, logged with its traceback.

    Pure ASGI (not BaseHTTPMiddleware), so streaming responses and their cancellation pass through untouched.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_tracking(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_tracking)
        except ClientDisconnect:
            return  # nobody left to answer
        except Exception:
            log.exception("internal error serving %s %s", scope.get("method"), scope.get("path"))
            if not started:
                response = error_response(500, "internal server error; the server logged the details")
                await response(scope, receive, send)
