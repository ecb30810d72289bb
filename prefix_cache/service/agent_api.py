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
honour) happens before the boundary is resolved, so a refused request caches nothing. An
unknown ``previous_response_id`` is refused only where the sidecar answers itself: an upstream
that serves Responses gets it as it was sent (it keeps its own responses, and decides). Errors
have the API's own shape (``prefix_cache.http.errors``). Stored responses are read and deleted
through ``prefix_cache.chat.responses_routes``, the router ``serve-engine`` mounts too.
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
from ..chat.backend import Usage
from ..chat.events import OutputEvent, backend_events
from ..chat.openai_chunks import completion_events
from ..chat.respond import json_response, stream_response
from ..chat.responses_params import ResponsesRequest, parse_responses_body
from ..chat.responses_routes import ResponsesScope, stored_responses_router
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


async def _responses_scope(state: State, tenant: Tenant) -> ResponsesScope:
    return ResponsesScope(state.responses, tenant)


router.include_router(stored_responses_router(
    _responses_scope, lambda ok: docs.responses(ok, 400, 401, 403, 404, 503)))

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
        result = await _prepare(state, tenant, model, call, len(raw), "messages")

    async def answer(events: Events, prompt_tokens: int, headers: dict[str, str]) -> Response:
        # Before generating, the sidecar knows the prompt and, on a hit, its static prefix.
        read = result.specprefill_system_end if result.hit else 0
        meta = MessageMeta(new_id("msg"), call.model or model.name, Usage(prompt_tokens, 0, read))
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
        conversation = messages_conversation(body)
        model = state.models.get(_model_name(body))
        result = await resolve(state, model, tenant, len(raw), conversation)
    return Response(json_io.dumps({"input_tokens": len(result.prompt_ids)}),
                    media_type="application/json", headers=cache_headers(result))


@router.post("/v1/responses", openapi_extra=docs.json_body(ResponsesRequest),
             responses=docs.responses(ResponseObject, *docs.PREPARE_ERRORS,
                                      *docs.UPSTREAM_ERRORS, headers=docs.CACHE_HEADERS,
                                      stream=True))
async def responses(request: Request, state: State, tenant: Tenant) -> Response:
    async with state.limits.slot(tenant):
        raw, body = await read_body(request, state)
        model = state.models.get(_model_name(body))
        upstream = model.upstream if model.engine is None else None
        owned_upstream = upstream is not None and upstream.speaks("responses")
        previous = body.get("previous_response_id")
        found = await state.responses.get(tenant, previous) if isinstance(previous, str) \
            else None
        parsed = parse_responses_body(body, lambda _: None if found is None else found.items,
                                      forward_unknown=owned_upstream)
        call = parsed.call
        result = await _prepare(state, tenant, model, call, len(raw), "responses")
    meta = ResponseMeta(new_id("resp"), call.model or model.name, parsed.echo())

    async def keep(response: dict[str, Any]) -> None:
        if parsed.store:
            await state.responses.put(tenant, parsed.record(response))

    async def answer(events: Events, _: int, headers: dict[str, str]) -> Response:
        if call.stream:
            return stream_response(response_stream(meta, events, keep), headers)
        return await json_response(request, response_json(meta, events, keep), headers)

    # Without the history, the prompt ids cut here are not the upstream's prompt: it renders
    # the conversation it keeps itself (the boundary, the static part's end, still holds).
    return await _generate(request, state, tenant, model, "responses", raw, body, call, result,
                           answer, tap=RelayedResponseRecorder(call.stream, keep),
                           error_event=_responses_error_event,
                           with_prompt_ids=parsed.previous_known)


def _model_name(body: dict[str, Any]) -> str | None:
    name = body.get("model")
    return name if isinstance(name, str) else None


async def _prepare(state: ServiceState, tenant: str, model: ServedModel, call: AgentCall,
                   body_size: int, api: str) -> PrefixResult:
    """The conversation's boundary, once the model can serve the call (a refused request
    caches nothing)."""
    if model.engine is not None:
        call.check_engine_support()
    elif not model.require_upstream().speaks(api):
        call.check_chat_support()
    conversation = call.conversation
    return await resolve(state, model, tenant, body_size, conversation)


async def _generate(request: Request, state: ServiceState, tenant: str, model: ServedModel,
                    api: str, raw: bytes, body: dict[str, Any], call: AgentCall,
                    result: PrefixResult, answer: Answer, tap: RelayTap | None = None,
                    error_event: Callable[[str], bytes] | None = None,
                    with_prompt_ids: bool = True) -> Response:
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
        content = upstream.forward_content(raw, body, result, namespace=tenant,
                                           with_prompt_ids=with_prompt_ids)
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
