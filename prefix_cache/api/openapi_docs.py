"""``GET /openapi.json``: the sidecar's API as FastAPI generates it, from the real models.

The routes read their bodies by hand (integers of any size kept exact, the raw bytes
forwarded unchanged), so FastAPI does not see a body parameter; each route declares its
request model here instead (``json_body``, as ``openapi_extra``) and its responses, errors
included (``responses``). ``install`` adds those request models and the bearer scheme to the
generated document's components.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from importlib import metadata
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from .schemas import AnthropicErrorResponse, ErrorResponse

OPENAPI_PATH = "/openapi.json"
REF = "#/components/schemas/{model}"
BEARER, API_KEY_HEADER = "bearerAuth", "apiKeyHeader"
ERROR_MODELS = (ErrorResponse, AnthropicErrorResponse)

ERRORS: dict[int | str, str] = {
    400: "Invalid request: bad JSON, fields, roles, a template that refuses the conversation",
    401: "Missing or unknown API key",
    403: "A key of the wrong kind for this endpoint, or the endpoint is disabled",
    404: "Unknown model",
    413: "The body (PREFIX_CACHE_MAX_BODY_BYTES, the connection is closed) or the prompt's "
         "text (PREFIX_CACHE_MAX_PROMPT_BYTES) is over its limit",
    415: "The body is not sent as Content-Type: application/json",
    429: "The tenant has too many requests in preparation and in line; retry after "
         "Retry-After seconds",
    502: "The upstream is unreachable, or answered a status that is not relayed (1xx, 3xx, "
         "600 and above)",
    503: "Not ready, shutting down (SIGTERM drains), or the shared store is unavailable for a "
         "purge; retry after Retry-After seconds",
    504: "The upstream did not answer in time",
    "4XX": "The upstream's own client error, relayed with its status",
    "5XX": "The upstream's own server error, relayed with its status",
}
# What every route that reads a tenant's body can answer besides its success.
PREPARE_ERRORS: tuple[int | str, ...] = (400, 401, 403, 404, 413, 415, 429)
UPSTREAM_ERRORS: tuple[int | str, ...] = (502, 504, "4XX", "5XX")
CACHE_HEADERS = {
    "x-prefix-cache": {"description": "hit, miss or none", "schema": {
        "type": "string", "enum": ["hit", "miss", "none"]}},
    "x-specprefill-system-end": {"description": "the boundary, in prompt tokens",
                                 "schema": {"type": "string", "pattern": "^[0-9]+$"}},
}
# One server-sent event (OpenAPI before 3.2: the schema of a stream describes each event).
SSE_EVENT = {"type": "object", "required": ["data"], "description": "with stream: true, the "
             "API's server-sent events, each event's data a JSON object (chat completions end "
             "with data: [DONE])",
             "properties": {"data": {"type": "string"}, "event": {"type": "string"},
                            "id": {"type": "string"}}}
_HEADERS_OF_ERROR = {
    401: {"WWW-Authenticate": {"schema": {"type": "string"}}},
    429: {"Retry-After": {"description": "seconds", "schema": {"type": "string"}}},
    503: {"Retry-After": {"description": "seconds", "schema": {"type": "string"}}},
}


def package_version() -> str:
    try:
        return metadata.version("prefix-cache")
    except metadata.PackageNotFoundError:  # run from a source tree that is not installed
        return "0+unknown"


def json_body(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` for a route whose body is ``model`` (read by hand, not by FastAPI)."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": REF.format(model=model.__name__)}}}}}


def responses(ok: type[BaseModel] | None, *errors: int | str,
              headers: Mapping[str, Any] | None = None, stream: bool = False,
              description: str = "OK",
              error_model: type[BaseModel] = ErrorResponse) -> dict[int | str, Any]:
    """``responses`` for a route: its success (``ok``'s JSON, or the route's own response
    class; also an SSE stream with ``stream``) and ``errors`` in the API's shape
    (``error_model``: OpenAI's by default)."""
    success: dict[str, Any] = {"description": description}
    if ok is not None:
        success["model"] = ok
    content: dict[str, Any] = {}
    if stream:
        content["text/event-stream"] = {"schema": SSE_EVENT}
    if content:
        success["content"] = content
    if headers:
        success["headers"] = dict(headers)
    out: dict[int | str, Any] = {200: success}
    for status in errors:
        # Errors are JSON whatever the route's own media type (/metrics is text, /dashboard
        # HTML): their schema is given as content, not as a model FastAPI would attach to it.
        error: dict[str, Any] = {"description": ERRORS[status], "content": {
            "application/json": {"schema": {"$ref": REF.format(model=error_model.__name__)}}}}
        if status in _HEADERS_OF_ERROR:
            error["headers"] = _HEADERS_OF_ERROR[status]
        out[status] = error
    return out


def install(app: FastAPI, body_models: Iterable[type[BaseModel]],
            bearer_paths: Iterable[str]) -> None:
    """Serve ``/openapi.json`` with ``body_models`` (and the error shape) in its components and
    the bearer scheme on the operations under ``bearer_paths`` (path prefixes)."""
    models: list[type[BaseModel]] = [*body_models, *ERROR_MODELS]
    prefixes = tuple(bearer_paths)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = get_openapi(title=app.title, version=app.version,
                                   description=app.description, routes=app.routes)
            _, defs = models_json_schema([(m, "validation") for m in models], ref_template=REF)
            components = document.setdefault("components", {})
            components.setdefault("schemas", {}).update(defs.get("$defs", {}))
            components["securitySchemes"] = {
                BEARER: {"type": "http", "scheme": "bearer",
                         "description": "Authorization: Bearer KEY (tenant, admin or metrics key)"},
                API_KEY_HEADER: {"type": "apiKey", "in": "header", "name": "x-api-key",
                                 "description": "a tenant key, as Anthropic clients send it"}}
            for path, operations in document.get("paths", {}).items():
                for operation in operations.values():
                    # FastAPI documents a 422 for routes with parameters; a bad parameter is
                    # a 400 here (prefix_cache.http.errors), already documented.
                    operation.get("responses", {}).pop("422", None)
                if not path.startswith(prefixes):
                    continue
                schemes: list[dict[str, list[str]]] = [{BEARER: []}]
                if path.startswith("/v1/messages"):
                    schemes.append({API_KEY_HEADER: []})
                for operation in operations.values():
                    operation["security"] = schemes
            app.openapi_schema = document
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
