"""``POST /v1/messages`` (Anthropic Messages) and ``/v1/messages/count_tokens``, for both
servers. Errors under ``/v1/messages`` have Anthropic's shape (``prefix_cache.http.errors``)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from ..chat.anthropic_encode import (
    AnthropicMessage,
    MessageMeta,
    TokenCount,
    message_json,
    message_stream,
)
from ..chat.anthropic_params import MessagesRequest, messages_conversation, parse_messages_body
from ..chat.respond import json_response, stream_response
from ..chat.responses_encode import new_id
from ..engine.protocol import Usage
from ..http.errors import anthropic_error_body
from ..http.sse import sse_event
from ..util import json_io
from . import openapi_docs as docs
from .deps import Caller, HostDep
from .host import Relay, Turn
from .pipeline import admit, hosted_left_out, model_name, prepare, run
from .schemas import AnthropicErrorResponse, CountTokensRequest

router = APIRouter()


@router.post("/v1/messages", openapi_extra=docs.json_body(MessagesRequest),
             responses=docs.responses(AnthropicMessage, *docs.PREPARE_ERRORS,
                                      *docs.UPSTREAM_ERRORS, headers=docs.CACHE_HEADERS,
                                      stream=True, error_model=AnthropicErrorResponse))
async def messages(request: Request, host: HostDep, tenant: Caller) -> Response:
    async with host.slot(tenant):  # released before generation, as for chat
        admitted = await admit(request, host, tenant, "messages")
        call = parse_messages_body(admitted.body)
        model = host.model(call.model)
        dropped = hosted_left_out(host, model, call, "messages")
        prompt = await prepare(host, "messages", model, call, admitted)
    headers = {**host.headers(prompt), **dropped}
    events = await run(model, Turn("messages", call, prompt, admitted.namespace, request),
                       Relay(admitted.raw, admitted.body, error_event=_error_event), headers)
    if isinstance(events, Response):
        return events  # the upstream's answer, relayed
    # Before generating, the prompt's length is known, not what its target will reuse (a hit
    # here is no promise that the upstream kept the KV): none is claimed until the engine
    # tells (events.Prefilled) or the upstream's usage comes with the end.
    meta = MessageMeta(new_id("msg"), call.model or model.name, Usage(len(prompt.ids), 0, 0))
    if call.stream:
        return stream_response(message_stream(meta, events), headers)
    return await json_response(request, message_json(meta, events), headers)


@router.post("/v1/messages/count_tokens", openapi_extra=docs.json_body(CountTokensRequest),
             responses=docs.responses(TokenCount, *docs.PREPARE_ERRORS,
                                      headers=docs.CACHE_HEADERS,
                                      error_model=AnthropicErrorResponse))
async def count_tokens(request: Request, host: HostDep, tenant: Caller) -> Response:
    """Anthropic's token count: the length of the prompt the conversation renders to, here
    (on the sidecar the boundary is resolved on the way, so the agent's first turn is a hit)."""
    async with host.slot(tenant):
        admitted = await admit(request, host, tenant, "messages")
        conversation = messages_conversation(admitted.body)
        model = host.model(model_name(admitted.body))
        result = await host.prepare(model, tenant, conversation, admitted.json)
    return Response(json_io.dumps({"input_tokens": len(result.ids)}),
                    media_type="application/json", headers=host.headers(result))


def _error_event(message: str) -> bytes:
    """A relayed Messages stream that breaks ends with Anthropic's error event."""
    return sse_event(anthropic_error_body(502, message), "error")
