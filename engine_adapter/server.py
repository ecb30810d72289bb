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
    GET  /health                {"status": "ok"} (with "disk_full": true while the KV disk
                                is full), or a 503 once the engine thread is down
                                (what the sidecar's /readyz probes)
    GET  /healthz, GET /readyz  as the sidecar's: the process is up ({"status": "ok"}); the
                                engine serves ({"status": "ready"}, else a 503 "not_ready"
                                with the engine's report). No key needed; 503 while draining.
    POST /admin/purge           {"namespace": NAME or null}: that namespace's KV (RAM and disk)
                                and stored responses deleted (null: all); the API key as for
                                every call. The sidecar's admin purge calls it on each replica.

A sidecar in front (``prefix-cache serve`` with an upstream of kind ``specprefill``) sends the
ids its cache cut the boundary in, the boundary, and the tenant as ``specprefill_namespace``.
Errors have OpenAI's shape ``{"error": {"message", "type", "code"}}``; bad input is a 400.

The routes under /v1 are the API layer both servers mount (``prefix_cache.api``), answered by
``engine_host.EngineHost``; its docstring has the trust model of ``specprefill_namespace``.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from prefix_cache.api import mount
from prefix_cache.chat.responses_store import DEFAULT_BYTES_PER_TENANT
from prefix_cache.engine import protocol as wire
from prefix_cache.http.errors import install_error_handlers
from prefix_cache.http.request_id import RequestIdMiddleware
from prefix_cache.http.drain import Drain, DrainMiddleware, drain_on_signals
from prefix_cache.metrics.engine import engine_exposition

from .backend import MLXBackend
from .engine_host import MAX_BODY_BYTES, EngineHost

log = logging.getLogger("engine_adapter.server")

DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8001
SHUTDOWN_GRACE_S = 10.0   # streams in flight finish within it after SIGTERM or SIGINT
EXIT_OK, EXIT_CONFIG = 0, 2


def create_engine_app(chat: MLXBackend, *, trust_namespace: bool = False,
                      api_key: str | None = None, max_body_bytes: int = MAX_BODY_BYTES,
                      close_engine: bool = True,
                      responses_store_bytes: int = DEFAULT_BYTES_PER_TENANT,
                      shutdown_grace_s: float = SHUTDOWN_GRACE_S) -> FastAPI:
    """The app serving the backend ``chat``; with ``close_engine`` it is closed at shutdown.
    SIGTERM and SIGINT drain it as they drain the sidecar (``prefix_cache.http.drain``)."""
    host = EngineHost(chat, trust_namespace=trust_namespace, api_key=api_key,
                      max_body_bytes=max_body_bytes, responses_store_bytes=responses_store_bytes)
    drain = Drain(shutdown_grace_s)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        restore_signals = drain_on_signals(drain)
        try:
            yield
        finally:
            restore_signals()
            host.close()
            if close_engine:
                await asyncio.to_thread(chat.close)

    # No trailing-slash redirects: their Location would be built from the client's Host header.
    app = FastAPI(title="prefix-cache engine", lifespan=lifespan, redirect_slashes=False,
                  docs_url=None, redoc_url=None, openapi_url=None)
    app.state.chat_engine = chat
    app.state.drain = drain
    install_error_handlers(app)
    # Outermost last: every response, the drain's 503 included, carries the request id.
    app.add_middleware(DrainMiddleware, drain=drain)
    app.add_middleware(RequestIdMiddleware)
    mount(app, host)  # /v1/models, chat completions, Messages, Responses: the sidecar's routes

    def readiness(ready: str, not_ready: str) -> JSONResponse:
        report = chat.health()
        if report["ok"]:   # a full KV disk costs recomputes, not readiness: said, still 200
            full = {"disk_full": True} if report.get("disk_full") else {}
            return JSONResponse({"status": ready, **full})
        return JSONResponse({"status": not_ready, "engine": report}, status_code=503)

    # The probes need no key. While draining, the drain answers all three with a 503.
    @app.get("/health")
    async def health() -> JSONResponse:   # what sidecars' /readyz probe (kept as it was)
        return readiness("ok", "unavailable")

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:   # the process is up: as the sidecar's
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz() -> JSONResponse:   # the engine serves: as the sidecar's statuses
        return readiness("ready", "not_ready")

    @app.post(wire.PURGE_PATH)
    async def purge(request: Request) -> dict[str, Any]:
        # What a tenant sent must not outlive its purge: the sidecar's admin purge calls this
        # on every replica (engine_host.EngineHost.purge).
        return await host.purge(request)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        # The engine's own counters (prefix_cache_engine_*: requests, KV store hits and misses,
        # prompt tokens reused and computed), for Prometheus and for what a pool routes to.
        host.caller(request)
        body, content_type = engine_exposition(chat.name, chat)
        return Response(body, media_type=content_type)

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
    from prefix_cache.http.connections import connection_options

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
                                           timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
                                           **connection_options()))
    log.info("serving %s%s; namespaces %s", chat.name,
             f" with draft {Path(draft_dir).name}" if draft_dir else "",
             "trusted from specprefill_namespace" if trust_namespace else "all 'default'")
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    return EXIT_OK if server.started else EXIT_CONFIG
