"""The agent APIs: ``POST /v1/messages`` (Anthropic Messages, and its
``/v1/messages/count_tokens``) and ``POST /v1/responses`` (OpenAI Responses), with the tenants,
boundary, ``x-prefix-cache`` / ``x-specprefill-system-end`` headers and metrics of
``/v1/chat/completions``.

Each body is converted to the chat-template conversation (``prefix_cache.chat``) and its
boundary resolved in the caller's namespace, then the request goes to the model's:

- in-process engine: the conversation's prompt ids and boundary, answered in the API's shape;
- upstream that serves the API itself (``upstream_apis``; our ``serve-engine`` does): the body
  unchanged (plus the boundary fields for ``specprefill`` upstreams), relayed as it comes;
- upstream that speaks only chat completions: the conversation as a chat completion, its answer
  (JSON or SSE) converted back to the API's shape.

Every refusal (a bad body, an unknown ``previous_response_id``, a parameter the engine does not
honour) happens before the boundary is resolved, so a refused request caches nothing. Errors
have the API's own shape (``prefix_cache.http.errors``).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

import httpx
from fastapi import APIRouter, Request
from fastapi.responses import Response

from .. import json_io
from ..cache import PrefixResult
from ..chat.agent_call import AgentCall
from ..chat.anthropic_params import MessagesRequest, messages_conversation, parse_messages_body
from ..chat.anthropic_stream import (
    AnthropicMessage,
    MessageMeta,
    TokenCount,
    message_json,
    message_stream,
)
from ..chat.events import OutputEvent, backend_events
from ..chat.openai_chunks import completion_events
from ..chat.respond import json_response, stream_response
from ..chat.responses_params import ResponsesRequest, parse_responses_body
from ..chat.responses_stream import (
    RelayedResponseRecorder,
    ResponseMeta,
    ResponseObject,
    new_id,
    response_json,
    response_stream,
)
from ..http.errors import ClientDisconnected, anthropic_error_body
from ..http.relay import RelayResponse, RelayTap, until_disconnect
from ..http.sse import sse_event
from . import openapi_docs as docs
from .api import cache_headers, resolve
from .deps import State, Tenant, read_body
from .models import ServedModel
from .schemas import AnthropicErrorResponse, CountTokensRequest
from .state import ServiceState

router = APIRouter()

Events = AsyncGenerator[OutputEvent, None]
# Answers a turn's events in the API's shape: (events, prompt tokens, headers) -> response.
Answer = Callable[[Events, int, dict[str, str]], Awaitable[Response]]


@router.post("/v1/messages", openapi_extra=docs.json_body(MessagesRequest),
             responses=docs.responses(AnthropicMessage, *docs.PREPARE_ERRORS,
                                      *docs.UPSTREAM_ERRORS, headers=docs.CACHE_HEADERS,
                                      stream=True, error_model=AnthropicErrorResponse))
async def messages(request: Request, state: State, tenant: Tenant) -> Response:
    async with state.limits.slot(tenant):  # released before generation, as for chat
        raw, body = await read_body(request, state)
        call = parse_messages_body(body)
        model = state.models.get(call.model)
        result = await _prepare(state, tenant, model, call, len(raw))

    async def answer(events: Events, prompt_tokens: int, headers: dict[str, str]) -> Response:
        meta = MessageMeta(new_id("msg"), call.model or model.name, prompt_tokens)
        if call.stream:
            return stream_response(message_stream(meta, events), headers)
        return await json_response(request, message_json(meta, events), headers)

    return await _generate(request, state, tenant, model, "messages", raw, body, call, result,
                           answer, error_event=_anthropic_error_event)


@router.post("/v1/messages/count_tokens", openapi_extra=docs.json_body(CountTokensRequest),
             responses=docs.responses(TokenCount, *docs.PREPARE_ERRORS,
                                      headers=docs.CACHE_HEADERS,
                                      error_model=AnthropicErrorResponse))
async def count_tokens(request: Request, state: State, tenant: Tenant) -> Response:
    """Anthropic's token count: the length of the prompt the conversation renders to, here
    (the boundary is resolved on the way, so the agent's first turn is then a hit)."""
    async with state.limits.slot(tenant):
        raw, body = await read_body(request, state)
        model_name = body.get("model")
        conversation = messages_conversation(body)
        model = state.models.get(model_name if isinstance(model_name, str) else None)
        result = await resolve(state, model, tenant, len(raw), conversation.messages,
                               conversation.tools, conversation.chat_template_kwargs)
    return Response(json_io.dumps({"input_tokens": len(result.prompt_ids)}),
                    media_type="application/json", headers=cache_headers(result))


@router.post("/v1/responses", openapi_extra=docs.json_body(ResponsesRequest),
             responses=docs.responses(ResponseObject, *docs.PREPARE_ERRORS,
                                      *docs.UPSTREAM_ERRORS, headers=docs.CACHE_HEADERS,
                                      stream=True))
async def responses(request: Request, state: State, tenant: Tenant) -> Response:
    async with state.limits.slot(tenant):
        raw, body = await read_body(request, state)
        parsed = parse_responses_body(body, lambda rid: state.responses.get(tenant, rid))
        call = parsed.call
        model = state.models.get(call.model)
        result = await _prepare(state, tenant, model, call, len(raw))
    meta = ResponseMeta(new_id("resp"), call.model or model.name, parsed.echo())

    def keep(response: dict[str, Any]) -> None:
        if parsed.store:
            state.responses.put(tenant, response["id"], parsed.conversation_items(response))

    async def answer(events: Events, _: int, headers: dict[str, str]) -> Response:
        if call.stream:
            return stream_response(response_stream(meta, events, keep), headers)
        return await json_response(request, response_json(meta, events, keep), headers)

    return await _generate(request, state, tenant, model, "responses", raw, body, call, result,
                           answer, tap=RelayedResponseRecorder(call.stream, keep),
                           error_event=_responses_error_event)


async def _prepare(state: ServiceState, tenant: str, model: ServedModel, call: AgentCall,
                   body_size: int) -> PrefixResult:
    """The conversation's boundary, once the model can serve the call (a refused request
    caches nothing)."""
    if model.engine is not None:
        call.check_engine_support()
    else:
        model.require_upstream()
    conversation = call.conversation
    return await resolve(state, model, tenant, body_size, conversation.messages,
                         conversation.tools, conversation.chat_template_kwargs)


async def _generate(request: Request, state: ServiceState, tenant: str, model: ServedModel,
                    api: str, raw: bytes, body: dict[str, Any], call: AgentCall,
                    result: PrefixResult, answer: Answer, tap: RelayTap | None = None,
                    error_event: Callable[[str], bytes] | None = None) -> Response:
    """Generate where the model runs, with the boundary ``_prepare`` resolved."""
    headers = cache_headers(result)
    if model.engine is not None:
        # The sidecar's prompt ids and boundary; the tenant is the namespace of the engine's KV.
        checked = model.engine.check(call.backend_request(
            result.prompt_ids, result.specprefill_system_end, tenant))
        return await answer(backend_events(model.engine, checked), len(result.prompt_ids),
                            headers)
    upstream = model.require_upstream()
    if upstream.speaks(api):
        content = upstream.forward_content(raw, body, result, namespace=tenant)
        response = await _open(request, state, model, api, content, tenant, result)
        return RelayResponse(response, headers, tap, error_event)
    chat = call.chat_body(call.model or model.name)
    content = upstream.forward_content(json_io.dumps(chat), chat, result, namespace=tenant)
    response = await _open(request, state, model, "chat", content, tenant, result)
    events = completion_events(response, stream=call.stream, prompt_tokens=len(result.prompt_ids))
    return await answer(events, len(result.prompt_ids), headers)


async def _open(request: Request, state: ServiceState, model: ServedModel, api: str,
                content: bytes, tenant: str, result: PrefixResult) -> httpx.Response:
    # Routed by the tenant's static prefix: its turns go where its KV is (pool.py).
    opened = model.require_pool().open(state.http, content, api, tenant=tenant, key=result.key)
    response, disconnected = await until_disconnect(request.receive, opened)
    if disconnected or response is None:
        raise ClientDisconnected("the client disconnected before the upstream answered")
    return response


def _anthropic_error_event(message: str) -> bytes:
    """A relayed Messages stream that breaks ends with Anthropic's error event."""
    return sse_event(anthropic_error_body(502, message), "error")


def _responses_error_event(message: str) -> bytes:
    """A relayed Responses stream that breaks ends with its API's error event."""
    return sse_event({"type": "error", "code": "upstream_interrupted", "message": message,
                      "param": None}, "error")
