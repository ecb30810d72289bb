"""The OpenAI-compatible surface: models, chat completions, and the boundary itself."""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response

from ..cache import PrefixResult
from ..chat.backend import ChatBackend
from ..chat.openai_params import parse_chat_params
from ..chat.openai_stream import respond_chat
from ..http.errors import ClientDisconnected
from ..http.relay import RelayResponse, until_disconnect
from .deps import State, Tenant, read_body
from .models import ServedModel
from .schemas import BoundaryRequest, ChatRequest
from .state import ServiceState

router = APIRouter()


def cache_headers(result: PrefixResult) -> dict[str, str]:
    return {"x-prefix-cache": result.cache,
            "x-specprefill-system-end": str(result.specprefill_system_end)}


async def resolve(state: ServiceState, model: ServedModel, body: dict[str, Any],
                  tenant: str) -> PrefixResult:
    """The boundary of a validated body, in the tenant's namespace (renders off the loop)."""
    return await state.cache.aresolve(
        model.tokenizer, body["messages"], body.get("tools"), body.get("chat_template_kwargs"),
        namespace=tenant, model=model.label,
    )


@router.get("/v1/models")
async def list_models(state: State, tenant: Tenant) -> dict[str, Any]:
    return {"object": "list", "data": [
        {"id": m.name, "object": "model", "created": state.started_at, "owned_by": "prefix-cache"}
        for m in state.models
    ]}


@router.post("/v1/prefix/boundary")
async def prefix_boundary(request: Request, state: State, tenant: Tenant) -> Response:
    _, body = await read_body(request, state)
    req = BoundaryRequest.model_validate(body)
    result = await resolve(state, state.models.get(req.model), body, tenant)
    out: dict[str, Any] = {
        "specprefill_system_end": result.specprefill_system_end,
        "prompt_tokens": len(result.prompt_ids),
        "cache": result.cache,
        "key": result.key,
    }
    if req.return_prompt_ids:
        out["prompt_ids"] = result.prompt_ids
    return Response(orjson.dumps(out), media_type="application/json",
                    headers=cache_headers(result))


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, state: State, tenant: Tenant) -> Response:
    raw, body = await read_body(request, state)
    req = ChatRequest.model_validate(body)
    model = state.models.get(req.model)
    if model.engine is not None:
        return await engine_completion(request, state, model, model.engine, body, tenant)
    upstream = model.require_upstream()  # before resolving: a refused request caches nothing
    result = await resolve(state, model, body, tenant)
    content = upstream.forward_content(raw, body, result, namespace=tenant)
    response, disconnected = await until_disconnect(request.receive,
                                                    upstream.open(state.http, content))
    if disconnected or response is None:
        raise ClientDisconnected("the client disconnected before the upstream answered")
    return RelayResponse(response, cache_headers(result))


async def engine_completion(request: Request, state: ServiceState, model: ServedModel,
                            engine: ChatBackend, body: dict[str, Any], tenant: str) -> Response:
    """A completion on the model's in-process engine: the sidecar's prompt ids and boundary,
    the tenant as the namespace of the engine's static-prefix KV (invariant 5)."""
    params = parse_chat_params(body, engine.name)  # before resolving: a refused request caches nothing
    result = await resolve(state, model, body, tenant)
    generation = params.request(result.prompt_ids, result.specprefill_system_end, tenant,
                                body.get("tools"))
    return await respond_chat(request, engine, params, generation, cache_headers(result))
