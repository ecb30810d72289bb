"""``GET /v1/models`` and ``POST /v1/chat/completions``, for both servers."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from ..chat.openai_encode import ChatMeta, completion_json, completion_stream
from ..chat.openai_params import parse_chat_body
from ..chat.respond import json_response, stream_response
from . import openapi_docs as docs
from .deps import Caller, HostDep
from .host import Relay, Turn
from .pipeline import admit, model_name, prepare, run
from .schemas import ChatCompletion, ChatCompletionRequest, ModelList

router = APIRouter()


@router.get("/v1/models", response_model=None, responses=docs.responses(ModelList, 401, 403))
async def list_models(host: HostDep, tenant: Caller) -> dict[str, Any]:
    return {"object": "list", "data": [
        {"id": m.name, "object": "model", "created": host.started_at, "owned_by": "prefix-cache"}
        for m in host.served()
    ]}


@router.post("/v1/chat/completions", openapi_extra=docs.json_body(ChatCompletionRequest),
             responses=docs.responses(ChatCompletion, *docs.PREPARE_ERRORS, *docs.UPSTREAM_ERRORS,
                                      headers=docs.CACHE_HEADERS, stream=True))
async def chat_completions(request: Request, host: HostDep, tenant: Caller) -> Response:
    async with host.slot(tenant):  # released before generation: the engine or upstream queues
        admitted = await admit(request, host, tenant, "chat")
        model = host.model(model_name(admitted.body))
        parsed = parse_chat_body(admitted.body, run_here=not model.target.relays("chat"))
        call = parsed.call
        prompt = await prepare(host, "chat", model, call, admitted)
    headers = host.headers(prompt)
    events = await run(model, Turn("chat", call, prompt, admitted.namespace, request),
                       Relay(admitted.raw, admitted.body), headers)
    if isinstance(events, Response):
        return events  # the upstream's answer, relayed
    meta = ChatMeta(call.model or model.name, parsed.include_usage)
    if call.stream:
        return stream_response(completion_stream(meta, events), headers)
    return await json_response(request, completion_json(meta, events), headers)
