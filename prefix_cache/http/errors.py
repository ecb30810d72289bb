"""HTTP errors of both servers, and the one place where every exception becomes a response.

Every error response has OpenAI's shape, ``{"error": {"message", "type", "code"}}``, so OpenAI
clients raise their usual exceptions with our message in them.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import InvalidRequestError, NoChatTemplateError, PrefixCacheError, TemplateRenderError

log = logging.getLogger("prefix_cache.service")

# nginx's "client closed request": logged, never read by anyone.
CLIENT_CLOSED_STATUS = 499


class ServiceError(Exception):
    """An error with its HTTP status and OpenAI error ``type`` and ``code``."""

    status = 500
    type = "server_error"
    code = "internal_error"

    def __init__(self, message: str, *, code: str | None = None,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        self.headers = dict(headers or {})


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


class ClientDisconnected(ServiceError):
    """The client went away; whatever was in flight for it was cancelled."""

    status, type, code = CLIENT_CLOSED_STATUS, "invalid_request_error", "client_closed_request"


class UpstreamStatusError(Exception):
    """The upstream answered with an error status: relayed with its status and its message."""

    def __init__(self, status: int, body: bytes, content_type: str | None) -> None:
        super().__init__(f"upstream answered {status}")
        self.status = status
        self.body = body
        self.content_type = content_type or ""


def error_body(message: str, type_: str, code: str | None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "code": code}}


def error_response(status: int, message: str, type_: str, code: str | None,
                   headers: Mapping[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, code), status_code=status, headers=headers)


def upstream_error_payload(exc: UpstreamStatusError) -> dict[str, Any]:
    """The upstream's error in OpenAI's shape: kept as is when it already is, else wrapped."""
    code = f"upstream_{exc.status}"
    try:
        data = orjson.loads(exc.body)
    except orjson.JSONDecodeError:
        data = None
    error = data.get("error") if isinstance(data, dict) else None
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return {"error": {**error, "type": error.get("type") or "upstream_error",
                          "code": error.get("code", code)}}
    if isinstance(error, str):  # mlx_lm.server: {"error": "text"}
        message = error
    else:
        message = exc.body.decode("utf-8", "replace").strip() or f"upstream answered {exc.status}"
    return error_body(message, "upstream_error", code)


def _validation_message(errors: list[Any]) -> str:
    parts = []
    for err in errors[:5]:
        loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
        parts.append(f"{loc}: {err.get('msg', 'invalid')}")
    more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
    return "invalid request: " + "; ".join(parts) + more


def install_error_handlers(app: FastAPI) -> None:
    """Map every exception the service can meet to its OpenAI-shaped response."""

    async def service_error(_: Request, exc: ServiceError) -> Response:
        if isinstance(exc, ClientDisconnected):
            log.info("client disconnected; upstream request cancelled")
        return error_response(exc.status, exc.message, exc.type, exc.code, exc.headers)

    async def upstream_status(_: Request, exc: UpstreamStatusError) -> Response:
        return JSONResponse(upstream_error_payload(exc), status_code=exc.status)

    async def library_error(_: Request, exc: PrefixCacheError) -> Response:
        if isinstance(exc, TemplateRenderError):
            return error_response(400, str(exc), "invalid_request_error", "template_error")
        if isinstance(exc, InvalidRequestError):
            return error_response(400, str(exc), "invalid_request_error", exc.code)
        if isinstance(exc, NoChatTemplateError):
            # The model's configuration lacks a template: the operator's to fix, not the client's.
            return error_response(500, str(exc), "server_error", "no_chat_template")
        log.error("unexpected library error: %s", exc)
        return error_response(500, str(exc), "server_error", "internal_error")

    async def invalid_body(_: Request, exc: ValidationError | RequestValidationError) -> Response:
        return error_response(400, _validation_message(list(exc.errors())),
                              "invalid_request_error", "invalid_type")

    async def http_error(_: Request, exc: StarletteHTTPException) -> Response:
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(exc.status_code, str(exc.detail), type_, f"http_{exc.status_code}",
                              exc.headers)

    async def unexpected(_: Request, exc: Exception) -> Response:
        log.exception("unhandled error", exc_info=exc)
        return error_response(500, "internal server error", "server_error", "internal_error")

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
