"""``prefix-cache serve-engine``: the MLX engine as its own OpenAI-compatible server.

    POST /v1/chat/completions   an OpenAI chat body, streaming or not, plus extension fields:
        prompt_token_ids        the prompt's token ids, used as given (no render); without
                                them the chat template is rendered (tools, chat_template_kwargs)
        specprefill_system_end  the static-prefix boundary in those ids (default 0: no reuse)
        specprefill_namespace   the namespace of the engine's static-prefix KV; read only with
                                --trust-namespace (see below)
        specprefill, specprefill_keep_pct, specprefill_threshold: per-request SpecPrefill knobs
    POST /v1/messages           an Anthropic Messages body, streaming or not (and
                                /v1/messages/count_tokens); POST /v1/responses
                                an OpenAI Responses body (``previous_response_id``: this
                                server's recent responses, per namespace; GET and DELETE
                                /v1/responses/{id} and GET /v1/responses/{id}/input_items
                                read and delete them, the namespace in the query's
                                ``specprefill_namespace``). Both take the same
                                extension fields; without ``prompt_token_ids`` the conversation
                                they convert to is rendered (prefix_cache.chat, the sidecar's
                                conversion). Errors under /v1/messages have Anthropic's shape.
    GET  /v1/models             the one model served (the ``model`` of a request is not checked)
    GET  /metrics               the engine's counters, Prometheus text (prefix_cache_engine_*)
    GET  /health                {"status": "ok"}, or a 503 once the engine thread is down
                                (what the sidecar's /readyz probes)

A sidecar in front (``prefix-cache serve`` with an upstream of kind ``specprefill``) sends the
ids its cache cut the boundary in, the boundary, and the tenant as ``specprefill_namespace``.
Errors have OpenAI's shape ``{"error": {"message", "type", "code"}}``; bad input is a 400.

Trust model. The engine keeps the KV of static prefixes per namespace, and a restored prefix
shows in time to first token, so whoever picks the namespace can probe what else was sent in
it. By default the server trusts no caller with that: ``specprefill_namespace`` is ignored and
every request is in namespace "default" -- right for a single-tenant engine, wrong behind a
multi-tenant sidecar (its tenants would share KV; the server logs a warning the first time the
field arrives and is ignored). ``--trust-namespace`` reads the field: use it only when the
callers that can reach the port are trusted to name tenants, i.e. the sidecar alone (bind to
loopback or a private network, and give ``--api-key`` to both: the sidecar's
``upstream_api_key`` is sent as ``Authorization: Bearer``). The sidecar derives the namespace
from its own API keys, never from the client's body.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from prefix_cache.chat.agent_call import AgentCall
from prefix_cache.chat.anthropic_params import messages_conversation, parse_messages_body
from prefix_cache.chat.anthropic_stream import MessageMeta, message_json, message_stream
from prefix_cache.chat.backend import Usage
from prefix_cache.chat.conversation import Conversation
from prefix_cache.chat.events import backend_events
from prefix_cache.chat.openai_params import parse_chat_params
from prefix_cache.chat.openai_stream import respond_chat
from prefix_cache.chat.respond import json_response, stream_response
from prefix_cache.chat.responses_params import parse_responses_body
from prefix_cache.chat.responses_routes import ResponsesScope, stored_responses_router
from prefix_cache.chat.responses_store import DEFAULT_BYTES_PER_TENANT, MemoryResponses
from prefix_cache.chat.responses_stream import ResponseMeta, new_id, response_json, response_stream
from prefix_cache.engine_metrics import engine_exposition
from prefix_cache.errors import InvalidRequestError
from prefix_cache.http.auth import bearer_matches, client_authorization, key_hint
from prefix_cache.http.body import read_json_object
from prefix_cache.http.errors import BadRequest, Unauthorized, install_error_handlers
from prefix_cache.keys import validate_label
from prefix_cache.messages import validate_kwargs, validate_messages, validate_tools
from prefix_cache.render import get_renderer
from prefix_cache.token_ids import validate_token_ids

from .backend import MLXBackend
from .mlx_engine.request import check_vocabulary

log = logging.getLogger("engine_adapter.server")

DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8001
DEFAULT_NAMESPACE = "default"
MAX_BODY_BYTES = 32 << 20  # prompt_token_ids of a long prompt are larger than its text
EXIT_OK, EXIT_CONFIG = 0, 2


def prompt_ids_of(body: dict[str, Any], vocab_size: int | None) -> list[int] | None:
    """``prompt_token_ids`` checked, or None when the body has none."""
    value = body.get("prompt_token_ids")
    if value is None:
        return None
    try:
        ids = validate_token_ids(value, "prompt_token_ids")
        check_vocabulary(ids, vocab_size, "prompt_token_ids")
    except InvalidRequestError as exc:  # the same check, named for this field
        raise InvalidRequestError(str(exc), code="invalid_prompt_token_ids") from None
    return ids


def boundary_of(body: dict[str, Any], n_ids: int) -> int:
    """``specprefill_system_end`` checked against the prompt's length (default 0)."""
    end = body.get("specprefill_system_end", 0)
    if end is None:
        return 0
    if isinstance(end, bool) or not isinstance(end, int) or not 0 <= end <= n_ids:
        raise BadRequest(f"specprefill_system_end must be an integer in [0, {n_ids}] (the "
                         f"prompt's token count), got {end!r}",
                         code="invalid_specprefill_system_end")
    return end


def render_prompt(tokenizer: Any, body: dict[str, Any]) -> list[int]:
    """The prompt ids of a chat body, rendered as the sidecar renders them (transformers'
    convention, with the request's tools and chat_template_kwargs)."""
    messages = validate_messages(body.get("messages"))
    tools = validate_tools(body.get("tools"))
    kwargs = validate_kwargs(body.get("chat_template_kwargs"))
    return get_renderer(tokenizer, None, tools).render_ids(messages, tools, kwargs)


async def prompt_of(chat: MLXBackend, body: dict[str, Any],
                    call: AgentCall | None = None) -> tuple[list[int], int]:
    """A request's prompt ids (given, or rendered off the event loop: a long template takes a
    while) and its boundary; ``call``: the agent API request whose conversation is rendered."""
    ids = prompt_ids_of(body, chat.vocab_size)
    if ids is None:
        chat_body = body if call is None else conversation_body(call.conversation)
        ids = await asyncio.to_thread(render_prompt, chat.tokenizer, chat_body)
    return ids, boundary_of(body, len(ids))


def conversation_body(c: Conversation) -> dict[str, Any]:
    """A conversation as the chat body ``render_prompt`` reads."""
    return {"messages": c.messages, "tools": c.tools, "chat_template_kwargs":
            c.chat_template_kwargs}


class _Namespaces:
    """Where a request's KV namespace comes from (see the module docstring)."""

    def __init__(self, trust: bool) -> None:
        self.trust = trust
        self._warned = False

    def of(self, body: Mapping[str, Any]) -> str:
        value = body.get("specprefill_namespace")
        if value is None:
            return DEFAULT_NAMESPACE
        if not self.trust:
            if not self._warned:
                self._warned = True
                log.warning("a request named specprefill_namespace but this server does not "
                            "trust it (no --trust-namespace): everything shares namespace "
                            "'default', so tenants of a sidecar in front share the engine's KV")
            return DEFAULT_NAMESPACE
        try:
            return validate_label(value, "specprefill_namespace")
        except ValueError as exc:
            raise BadRequest(str(exc), code="invalid_specprefill_namespace") from None


def create_engine_app(chat: MLXBackend, *, trust_namespace: bool = False,
                      api_key: str | None = None, max_body_bytes: int = MAX_BODY_BYTES,
                      close_engine: bool = True,
                      responses_store_bytes: int = DEFAULT_BYTES_PER_TENANT) -> FastAPI:
    """The app serving the backend ``chat``; with ``close_engine`` it is closed at shutdown."""
    namespaces = _Namespaces(trust_namespace)
    stored = MemoryResponses(responses_store_bytes)
    started = int(time.time())

    def check_key(request: Request) -> None:
        if not api_key:
            return
        given = client_authorization(request.headers.get("authorization"),
                                     request.headers.get("x-api-key"))
        if not bearer_matches(given, api_key):
            raise Unauthorized(f"missing or wrong API key: send it as {key_hint(request.url.path)}")

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            if close_engine:
                await asyncio.to_thread(chat.close)

    # No trailing-slash redirects: their Location would be built from the client's Host header.
    app = FastAPI(title="prefix-cache engine", lifespan=lifespan, redirect_slashes=False,
                  docs_url=None, redoc_url=None, openapi_url=None)
    app.state.chat_engine = chat
    install_error_handlers(app)

    @app.get("/health")
    async def health() -> JSONResponse:
        report = chat.health()
        if report["ok"]:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable", "engine": report}, status_code=503)

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        check_key(request)
        return {"object": "list", "data": [{"id": chat.name, "object": "model",
                                            "created": started, "owned_by": "prefix-cache"}]}

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        # The engine's own counters (prefix_cache_engine_*: requests, KV store hits and misses,
        # prompt tokens reused and computed), for Prometheus and for what a pool routes to.
        check_key(request)
        body, content_type = engine_exposition(chat.name, chat)
        return Response(body, media_type=content_type)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        check_key(request)
        _, body = await read_json_object(request, max_body_bytes)
        params = parse_chat_params(body, chat.name)
        namespace = namespaces.of(body)
        ids, end = await prompt_of(chat, body)
        generation = params.request(ids, end, namespace, body.get("tools"))
        return await respond_chat(request, chat, params, generation)

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        check_key(request)
        _, body = await read_json_object(request, max_body_bytes)
        call = parse_messages_body(body)
        call.check_engine_support()
        namespace = namespaces.of(body)
        ids, end = await prompt_of(chat, body, call)
        events = backend_events(chat, chat.check(call.backend_request(ids, end, namespace)))
        # The engine's own counts replace these once it has prefilled (events.Prefilled).
        meta = MessageMeta(new_id("msg"), call.model or chat.name, Usage(len(ids), 0))
        if call.stream:
            return stream_response(message_stream(meta, events))
        return await json_response(request, message_json(meta, events))

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Response:
        check_key(request)
        _, body = await read_json_object(request, max_body_bytes)
        chat_body = conversation_body(messages_conversation(body))
        ids = await asyncio.to_thread(render_prompt, chat.tokenizer, chat_body)
        return JSONResponse({"input_tokens": len(ids)})

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        check_key(request)
        _, body = await read_json_object(request, max_body_bytes)
        namespace = namespaces.of(body)
        previous = body.get("previous_response_id")
        found = await stored.get(namespace, previous) if isinstance(previous, str) else None
        parsed = parse_responses_body(body, lambda _: None if found is None else found.items)
        call = parsed.call
        call.check_engine_support()
        ids, end = await prompt_of(chat, body, call)
        events = backend_events(chat, chat.check(call.backend_request(ids, end, namespace)))
        meta = ResponseMeta(new_id("resp"), call.model or chat.name, parsed.echo())

        async def keep(response: dict[str, Any]) -> None:
            if parsed.store:
                await stored.put(namespace, parsed.record(response))

        if call.stream:
            return stream_response(response_stream(meta, events, keep))
        return await json_response(request, response_json(meta, events, keep))

    async def responses_scope(request: Request) -> ResponsesScope:
        """GET and DELETE have no body: the namespace is the query's specprefill_namespace,
        read under the same trust as the body field."""
        check_key(request)
        return ResponsesScope(stored, namespaces.of(request.query_params))

    app.include_router(stored_responses_router(responses_scope))
    return app


def serve_engine(model_dir: str | Path, draft_dir: str | Path | None = None, *,
                 host: str = DEFAULT_HOST, port: int = DEFAULT_PORT,
                 trust_namespace: bool = False, api_key: str | None = None,
                 log_level: str = "info",
                 engine_options: Mapping[str, Any] | None = None) -> int:
    """Load the model and serve it until stopped; the exit code. ``engine_options``: see
    ``engine_adapter.options``."""
    import uvicorn

    from prefix_cache.http.logs import uvicorn_log_config

    from .options import EngineOptions

    try:
        options = EngineOptions.parse(engine_options)
    except ValueError as exc:
        print(f"prefix-cache serve-engine: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    try:
        chat = MLXBackend.load(model_dir, draft_dir, **options.engine_kwargs())
    except (OSError, ValueError, ImportError) as exc:
        print(f"prefix-cache serve-engine: cannot load the model: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    app = create_engine_app(chat, trust_namespace=trust_namespace, api_key=api_key)
    config = uvicorn_log_config(log_level, ("prefix_cache", "engine_adapter"))
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                           log_config=config, server_header=False,
                                           timeout_graceful_shutdown=10))  # sets up logging
    log.info("serving %s%s; namespaces %s", chat.name,
             f" with draft {Path(draft_dir).name}" if draft_dir else "",
             "trusted from specprefill_namespace" if trust_namespace else "all 'default'")
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    return EXIT_OK if server.started else EXIT_CONFIG
