"""``GET /openapi.json``: every route described, with its request model and every response it
gives; schemathesis sends what the document allows and finds no 500 and no undocumented
status, content type, header or body (a live sidecar on loopback, a recording upstream)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.routing import APIRoute

from prefix_cache.api.schemas import ChatRequest
from prefix_cache.service.upstream import Upstream

from tests.support.loopback import local_client
from tests.support.recording_upstream import Recorder
from tests.support.sidecar import bearer, served, sidecar_app

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis.specs.openapi import checks as openapi_checks  # noqa: E402


ADMIN, METRICS = "sk-openapi-admin", "sk-openapi-metrics"
# Bounded: the whole run takes seconds to a minute on two shared cores.
EXAMPLES_PER_OPERATION = 25
CHECKS = [schemathesis.checks.not_a_server_error, openapi_checks.status_code_conformance,
          openapi_checks.content_type_conformance, openapi_checks.response_schema_conformance,
          openapi_checks.response_headers_conformance]


@pytest.fixture(scope="module")
def app(recorder_server: tuple[Recorder, str], demo_tokenizer: Any) -> Any:
    return sidecar_app(served("rec", demo_tokenizer, Upstream(recorder_server[1])),
                       served("boundary-only", demo_tokenizer),
                       admin_keys=[ADMIN], metrics_keys=[METRICS], max_body_bytes=256 * 1024)


@pytest.fixture(scope="module")
def document(base: str) -> dict[str, Any]:
    with local_client(base_url=base) as http:
        r = http.get("/openapi.json")
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    return dict(r.json())


def api_routes(routes: Any) -> Iterator[APIRoute]:
    """Every API route, through included routers (FastAPI keeps those as their own nodes)."""
    for route in routes:
        if isinstance(route, APIRoute):
            yield route
        elif hasattr(route, "original_router"):
            yield from api_routes(route.original_router.routes)
        elif hasattr(route, "routes"):
            yield from api_routes(route.routes)


def test_every_route_is_in_the_document(app: Any, document: dict[str, Any]) -> None:
    routes = {(method.lower(), route.path) for route in api_routes(app.routes)
              if route.include_in_schema for method in route.methods}
    assert len(routes) >= 10
    described = {(method, path) for path, ops in document["paths"].items() for method in ops}
    assert routes == described
    schemas = document["components"]["schemas"]
    for path, ops in document["paths"].items():
        for method, op in ops.items():
            assert "200" in op["responses"], (method, path)
            if method == "post":   # every body is described by a model in the components
                ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
                assert ref.rsplit("/", 1)[1] in schemas
            for status, response in op["responses"].items():
                if status.startswith(("4", "5")):
                    shape = "AnthropicErrorResponse" if path.startswith("/v1/messages") else (
                        "ReadyReport" if path == "/readyz" else "ErrorResponse")
                    assert response["content"]["application/json"]["schema"]["$ref"] == (
                        f"#/components/schemas/{shape}"), (method, path, status)


def test_the_request_models_cover_the_fields_the_routes_read(document: dict[str, Any]) -> None:
    schemas = document["components"]["schemas"]
    chat = schemas["ChatCompletionRequest"]
    assert set(ChatRequest.model_fields) <= set(chat["properties"])
    assert chat["required"] == ["messages"] and chat["additionalProperties"] is True
    roles = schemas["ChatMessage"]["properties"]["role"]["enum"]
    assert roles == ["system", "developer", "user", "assistant", "tool"]
    assert "return_prompt_ids" in schemas["PrefixBoundaryRequest"]["properties"]
    assert schemas["PurgeRequest"]["additionalProperties"] is False
    assert document["components"]["securitySchemes"]["bearerAuth"]["scheme"] == "bearer"
    errors = document["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert {"400", "401", "404", "413", "415", "429", "502", "504"} <= set(errors)
    assert "Retry-After" in errors["429"]["headers"]


def test_the_document_describes_the_agent_routes(document: dict[str, Any]) -> None:
    schemas = document["components"]["schemas"]
    for path, required, answer in [
            ("/v1/messages", {"model", "max_tokens", "messages"}, "AnthropicMessage"),
            ("/v1/messages/count_tokens", {"messages"}, "TokenCount"),
            ("/v1/responses", {"input"}, "ResponseObject")]:
        operation = document["paths"][path]["post"]
        ref = operation["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert set(schemas[ref.rsplit("/", 1)[1]]["required"]) == required, path
        assert operation["responses"]["200"]["content"]["application/json"]["schema"] \
            == {"$ref": f"#/components/schemas/{answer}"}


def test_a_documented_example_is_served(base: str, document: dict[str, Any]) -> None:
    """The document describes what the routes really take: a body built from the models is
    answered 200, with the documented response shape."""
    body = {"model": "rec", "messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}
    with local_client(base_url=base) as http:
        r = http.post("/v1/prefix/boundary", json=body)
    assert r.status_code == 200
    assert set(r.json()) <= set(document["components"]["schemas"]["BoundaryResponse"]["properties"])


@pytest.fixture(scope="module")
def api_schema(base: str) -> Any:
    return schemathesis.openapi.from_url(f"{base}/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck), database=None)
def test_schemathesis_finds_no_server_error_and_nothing_undocumented(case: Any) -> None:
    case.call_and_validate(headers=bearer(ADMIN), checks=CHECKS,
                           timeout=30)
