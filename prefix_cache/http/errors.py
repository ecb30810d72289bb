"""HTTP errors of both servers, and the one place where every exception becomes a response.

Error responses have the shape of the API the request was made to, so each API's clients raise
their usual exceptions with our message in them: OpenAI's ``{"error": {"message", "type",
"code"}}`` (``param`` too where one field is to blame) everywhere, except under
``/v1/messages``, Anthropic's ``{"type": "error", "error": {"type", "message"}}``.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import (
    ContextLengthError,
    InvalidRequestError,
    NoChatTemplateError,
    PrefixCacheError,
    StoreUnavailableError,
    TemplateRenderError,
)
from .sse import sse_event

log = logging.getLogger("prefix_cache.service")

# nginx's "client closed request": logged, never read by anyone.
CLIENT_CLOSED_STATUS = 499


class ServiceError(Exception):
    """An error with its HTTP status, OpenAI error ``type`` and ``code`` (and the request
    field to blame, ``param``, when there is one)."""

    status = 500
    type = "server_error"
    code = "internal_error"

    def __init__(self, message: str, *, code: str | None = None,
                 headers: Mapping[str, str] | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        self.headers = dict(headers or {})
        self.param = param


class BadRequest(ServiceError):
    status, type, code = 400, "invalid_request_error", "invalid_request"


class Unauthorized(ServiceError):
    status, type, code = 401, "invalid_request_error", "invalid_api_key"

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message, code=code, headers={"WWW-Authenticate": "Bearer"})


class Forbidden(ServiceError):
    status, type, code = 403, "permission_error", "forbidden"


class NotFound(ServiceError):
    status, type, code = 404, "not_found_error", "not_found"


class PayloadTooLarge(ServiceError):
    status, type, code = 413, "invalid_request_error", "request_too_large"


class ServiceUnavailable(ServiceError):
    """Something this service needs is down (the shared store) or it is shutting down: retry."""

    status, type, code = 503, "server_error", "service_unavailable"


class UnsupportedMediaType(ServiceError):
    status, type, code = 415, "invalid_request_error", "unsupported_media_type"


class TooManyRequests(ServiceError):
    """Over a limit for now: try again after ``retry_after_s`` seconds."""

    status, type, code = 429, "rate_limit_error", "rate_limit_exceeded"

    def __init__(self, message: str, *, retry_after_s: int, code: str | None = None) -> None:
        super().__init__(message, code=code, headers={"Retry-After": str(retry_after_s)})


class UpstreamUnavailable(ServiceError):
    """The upstream could not be reached or did not answer in time."""

    status, type, code = 502, "upstream_error", "upstream_unavailable"


class UpstreamTimeout(UpstreamUnavailable):
    status, code = 504, "upstream_timeout"


class UpstreamBadStatus(UpstreamUnavailable):
    """The upstream answered with a status that is not relayed (see ``relay.relays_status``)."""

    code = "upstream_bad_status"


class EngineFailed(ServiceError):
    """An engine could not finish a generation it had accepted."""

    status, type, code = 500, "server_error", "engine_error"


class ClientDisconnected(ServiceError):
    """The client went away; whatever was in flight for it was cancelled."""

    status, type, code = CLIENT_CLOSED_STATUS, "invalid_request_error", "client_closed_request"


class UpstreamStatusError(Exception):
    """The upstream answered with an error status: relayed with its status, its message and
    the headers a client's backoff reads (``relay.client_headers``)."""

    def __init__(self, status: int, body: bytes, content_type: str | None,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(f"upstream answered {status}")
        self.status = status
        self.body = body
        self.content_type = content_type or ""
        self.headers = dict(headers or {})


def error_body(message: str, type_: str, code: str | None,
               param: str | None = None) -> dict[str, Any]:
    error: dict[str, Any] = {"message": message, "type": type_, "code": code}
    if param is not None:
        error["param"] = param
    return {"error": error}


# Paths whose errors take Anthropic's shape (both servers serve the Messages API there), also
# behind a proxy that mounts them under a prefix.
ANTHROPIC_PATH = re.compile(r"/v1/messages(/|$)")
# Anthropic's error type for each status; other 5xx are "api_error".
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                   403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                   429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}


def is_anthropic_path(path: str) -> bool:
    return ANTHROPIC_PATH.search(path) is not None


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error shape, its type from the status."""
    type_ = ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": type_, "message": message}}


RESPONSES_PATH = re.compile(r"/v1/responses(/|$)")


def stream_error_event(message: str, code: str, path: str = "") -> bytes:
    """The event that ends a stream cut by the server (not the engine) in the shape of the
    API at ``path``: Anthropic's ``error`` event, the Responses API's ``error`` event, or a
    chat completion stream's ``data: {"error": ...}``."""
    if is_anthropic_path(path):
        return sse_event(anthropic_error_body(503, message), "error")
    if RESPONSES_PATH.search(path):
        return sse_event({"type": "error", "code": code, "message": message, "param": None},
                         "error")
    return sse_event(error_body(message, "server_error", code))


def error_response(status: int, message: str, type_: str, code: str | None,
                   headers: Mapping[str, str] | None = None, *, path: str = "",
                   param: str | None = None) -> JSONResponse:
    """The error in the shape of the API at ``path``."""
    if is_anthropic_path(path):
        return JSONResponse(anthropic_error_body(status, message), status_code=status,
                            headers=headers)
    return JSONResponse(error_body(message, type_, code, param), status_code=status,
                        headers=headers)


def upstream_error_payload(exc: UpstreamStatusError, path: str = "") -> dict[str, Any]:
    """The upstream's error in the shape of the API at ``path``: kept as is when it already
    has that shape, else its message wrapped."""
    code = f"upstream_{exc.status}"
    try:
        data = orjson.loads(exc.body)
    except orjson.JSONDecodeError:
        data = None
    error = data.get("error") if isinstance(data, dict) else None
    if is_anthropic_path(path):
        if isinstance(data, dict) and data.get("type") == "error" and isinstance(error, dict) \
                and isinstance(error.get("message"), str):
            return data
    elif isinstance(error, dict) and isinstance(error.get("message"), str):
        return {"error": {**error, "type": error.get("type") or "upstream_error",
                          "code": error.get("code", code)}}
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        message = error["message"]  # OpenAI's shape, for an Anthropic client
    elif isinstance(error, str):  # mlx_lm.server: {"error": "text"}
        message = error
    else:
        message = exc.body.decode("utf-8", "replace").strip() or f"upstream answered {exc.status}"
    if is_anthropic_path(path):
        return anthropic_error_body(exc.status, message)
    return error_body(message, "upstream_error", code)


# pydantic names the member of a union that failed ("str", "list[dict[str,any]]"): not a field.
_UNION_MEMBERS = frozenset(("str", "int", "float", "bool", "dict", "list", "none"))


def _validation_message(errors: list[Any]) -> str:
    parts = []
    for err in errors[:5]:
        loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body" and not (
            isinstance(p, str) and (p in _UNION_MEMBERS or "[" in p))) or "body"
        parts.append(f"{loc}: {err.get('msg', 'invalid')}")
    more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
    return "invalid request: " + "; ".join(parts) + more


def install_error_handlers(app: FastAPI) -> None:
    """Map every exception the service can meet to its response, in the shape of the API the
    request was made to."""

    async def service_error(request: Request, exc: ServiceError) -> Response:
        if isinstance(exc, ClientDisconnected):
            log.info("client disconnected; upstream request cancelled")
        return error_response(exc.status, exc.message, exc.type, exc.code, exc.headers,
                              path=request.url.path, param=exc.param)

    async def upstream_status(request: Request, exc: UpstreamStatusError) -> Response:
        return JSONResponse(upstream_error_payload(exc, request.url.path),
                            status_code=exc.status, headers=exc.headers)

    async def library_error(request: Request, exc: PrefixCacheError) -> Response:
        path = request.url.path
        if isinstance(exc, TemplateRenderError):
            return error_response(400, str(exc), "invalid_request_error", "template_error",
                                  path=path)
        if isinstance(exc, ContextLengthError):
            message = exc.anthropic_message() if is_anthropic_path(path) \
                else exc.openai_message()
            return error_response(400, message, "invalid_request_error", exc.code, path=path)
        if isinstance(exc, InvalidRequestError):
            return error_response(400, str(exc), "invalid_request_error", exc.code, path=path)
        if isinstance(exc, NoChatTemplateError):
            # The model's configuration lacks a template: the operator's to fix, not the client's.
            return error_response(500, str(exc), "server_error", "no_chat_template", path=path)
        if isinstance(exc, StoreUnavailableError):
            # Lookups turn store failures into recomputes; what reaches here is an operation
            # that needs the store itself (an admin purge). Its details stay in the log.
            log.warning("store unavailable: %s", exc)
            return error_response(503, "the cache store is unavailable; try again",
                                  "server_error", "store_unavailable", {"Retry-After": "5"},
                                  path=path)
        log.error("unexpected library error: %s", exc)
        return error_response(500, str(exc), "server_error", "internal_error", path=path)

    async def invalid_body(request: Request,
                           exc: ValidationError | RequestValidationError) -> Response:
        return error_response(400, _validation_message(list(exc.errors())),
                              "invalid_request_error", "invalid_type", path=request.url.path)

    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(exc.status_code, str(exc.detail), type_, f"http_{exc.status_code}",
                              exc.headers, path=request.url.path)

    async def unexpected(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error", exc_info=exc)
        return error_response(500, "internal server error", "server_error", "internal_error",
                              path=request.url.path)

    handlers: list[tuple[type[Exception], Any]] = [
        (ServiceError, service_error),
        (UpstreamStatusError, upstream_status),
        (PrefixCacheError, library_error),
        (ValidationError, invalid_body),
        (RequestValidationError, invalid_body),
        (StarletteHTTPException, http_error),
        (Exception, unexpected),
    ]
    for exc_class, handler in handlers:
        app.add_exception_handler(exc_class, handler)
