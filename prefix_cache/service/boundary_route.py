"""``POST /v1/prefix/boundary``: the boundary itself, the sidecar's own endpoint.

It is the sidecar's hot path, so it is served by a plain Starlette route (``fast_lane``) that
the app matches before any router: FastAPI's per-request machinery around an endpoint
(dependency solving, its request-response wrapper) cost a hit ~30 us. The FastAPI route below
is the same endpoint, declared for the OpenAPI document.
"""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.routing import Route

from ..api import openapi_docs as docs
from ..api.schemas import BoundaryResponse, PrefixBoundaryRequest, boundary_fields
from ..chat.render_fields import chat_conversation
from ..util.token_ids import json_token_ids
from .sidecar_host import SidecarHost, cache_headers

router = APIRouter()


@router.post("/v1/prefix/boundary", openapi_extra=docs.json_body(PrefixBoundaryRequest),
             responses=docs.responses(BoundaryResponse, *docs.PREPARE_ERRORS,
                                      headers=docs.CACHE_HEADERS))
async def prefix_boundary(request: Request) -> Response:
    # No FastAPI dependencies: on a hit, resolving them cost as much as the key (issue 30).
    host: SidecarHost = request.app.state.api_host
    tenant = host.caller(request)
    async with host.slot(tenant):  # the tenant's share of this worker
        # Shared parts: this body is only validated and resolved (the cache changes nothing).
        body = await host.read_body(request, tenant, share=True)
        model, return_ids = boundary_fields(body.data)
        # Prompt ids the client sends are the ids the boundary is cut against (no render).
        result = await host.resolve(host.state.models.get(model), tenant,
                                    chat_conversation(body.data), len(body.raw),
                                    json_token_ids(body.data.get("prompt_ids")), body.hints)
    out: dict[str, Any] = {
        "specprefill_system_end": result.specprefill_system_end,
        "prompt_tokens": result.prompt_tokens,
        "cache": result.cache,
        "key": result.key,
    }
    if return_ids:
        out["prompt_ids"] = result.prompt_ids
    return Response(orjson.dumps(out), media_type="application/json",
                    headers=cache_headers(result))


def fast_lane() -> Route:
    """``prefix_boundary`` as a plain Starlette route (same errors: the app's handlers)."""
    (declared,) = router.routes
    assert isinstance(declared, Route)
    return Route(declared.path, prefix_boundary, methods=["POST"], include_in_schema=False)
