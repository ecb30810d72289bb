"""The OpenAI-compatible surface: models, chat completions, and the boundary itself."""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response

from ..cache import PrefixResult
from ..chat.conversation import Conversation
from ..chat.openai_params import parse_chat_params
from ..chat.openai_stream import respond_chat
from ..chat.render_fields import chat_conversation
from ..http.errors import ClientDisconnected
from ..http.relay import RelayResponse, until_disconnect
from . import openapi_docs as docs
from .deps import State, Tenant, read_body
from .models import ServedModel
from .schemas import (
    BoundaryRequest,
    BoundaryResponse,
    ChatCompletion,
    ChatCompletionRequest,
    ChatRequest,
    ModelList,
    PrefixBoundaryRequest,
)
from .state import ServiceState

router = APIRouter()


def cache_headers(result: PrefixResult) -> dict[str, str]:
    return {"x-prefix-cache": result.cache,
            "x-specprefill-system-end": str(result.specprefill_system_end)}


async def resolve(state: ServiceState, model: ServedModel, tenant: str, body_size: int,
                  conversation: Conversation, prompt_ids: Any = None) -> PrefixResult:
    """The boundary of a validated conversation (of any API), in the tenant's namespace,
    within the tenant's prompt size limit; long renders run off the loop. ``prompt_ids``: the
    client's own (checked by the cache: a 400 unless token ids)."""
    c = conversation
    state.limits.check_prompt(tenant, body_size, c.messages, c.tools, c.chat_template_kwargs)
    return await state.cache.aresolve(
        model.tokenizer, c.messages, c.tools, c.chat_template_kwargs, namespace=tenant,
        model=model.label, chat_template=c.chat_template,
        add_generation_prompt=c.add_generation_prompt,
        continue_final_message=c.continue_final_message, prompt_ids=prompt_ids)


async def resolve_chat(state: ServiceState, model: ServedModel, body: dict[str, Any],
                       tenant: str, body_size: int, prompt_ids: Any = None) -> PrefixResult:
    """The boundary of a validated chat body, rendered as its request-level fields say."""
    return await resolve(state, model, tenant, body_size, chat_conversation(body), prompt_ids)


@router.get("/v1/models", response_model=None, responses=docs.responses(ModelList, 401, 403))
async def list_models(state: State, tenant: Tenant) -> dict[str, Any]:
    return {"object": "list", "data": [
        {"id": m.name, "object": "model", "created": state.started_at, "owned_by": "prefix-cache"}
        for m in state.models
    ]}


@router.post("/v1/prefix/boundary", openapi_extra=docs.json_body(PrefixBoundaryRequest),
             responses=docs.responses(BoundaryResponse, *docs.PREPARE_ERRORS,
                                      headers=docs.CACHE_HEADERS))
async def prefix_boundary(request: Request, state: State, tenant: Tenant) -> Response:
    async with state.limits.slot(tenant):  # the tenant's share of this worker
        raw, body = await read_body(request, state)
        req = BoundaryRequest.model_validate(body)
        # Prompt ids the client sends are the ids the boundary is cut against (no render).
        result = await resolve_chat(state, state.models.get(req.model), body, tenant,
                                    len(raw), body.get("prompt_ids"))
    out: dict[str, Any] = {
        "specprefill_system_end": result.specprefill_system_end,
        "prompt_tokens": result.prompt_tokens,
        "cache": result.cache,
        "key": result.key,
    }
    if req.return_prompt_ids:
        out["prompt_ids"] = result.prompt_ids
    return Response(orjson.dumps(out), media_type="application/json",
                    headers=cache_headers(result))


@router.post("/v1/chat/completions", openapi_extra=docs.json_body(ChatCompletionRequest),
             responses=docs.responses(ChatCompletion, *docs.PREPARE_ERRORS, *docs.UPSTREAM_ERRORS,
                                      headers=docs.CACHE_HEADERS, stream=True))
async def chat_completions(request: Request, state: State, tenant: Tenant) -> Response:
    async with state.limits.slot(tenant):  # released before generation: the upstream queues that
        raw, body = await read_body(request, state)
        req = ChatRequest.model_validate(body)
        model = state.models.get(req.model)
        if model.engine is not None:
            # Parameters before resolving: a refused request caches nothing.
            params = parse_chat_params(body, model.engine.name)
            result = await resolve_chat(state, model, body, tenant, len(raw))
            # The tenant is the namespace of the engine's static-prefix KV (invariant 5).
            generation = params.request(result.prompt_ids, result.specprefill_system_end, tenant,
                                        body.get("tools"))
        else:
            upstream = model.require_upstream()  # before resolving: a refused request caches nothing
            result = await resolve_chat(state, model, body, tenant, len(raw))
            content = upstream.forward_content(raw, body, result, namespace=tenant)
    if model.engine is not None:
        return await respond_chat(request, model.engine, params, generation, cache_headers(result))
    # Routed by the tenant's static prefix: its turns go where its KV is (pool.py).
    opened = model.require_pool().open(state.http, content, tenant=tenant, key=result.key)
    response, disconnected = await until_disconnect(request.receive, opened)
    if disconnected or response is None:
        raise ClientDisconnected("the client disconnected before the upstream answered")
    return RelayResponse(response, cache_headers(result))
