"""The sidecar's FastAPI app: one cache, one store, the configured models and tenants."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI

from ..api import mount, openapi_docs
from ..api.schemas import (
    ChatCompletionRequest,
    CountTokensRequest,
    PrefixBoundaryRequest,
    PurgeRequest,
)
from ..cache.cache import StaticPrefixCache
from ..chat.anthropic_params import MessagesRequest
from ..chat.responses_params import ResponsesRequest
from ..chat.responses_store import MemoryResponses, ResponseStore, SharedResponses
from ..http.errors import install_error_handlers
from ..http.request_id import RequestIdMiddleware
from ..http.request_record import RequestRecordMiddleware
from ..http.drain import Drain, DrainMiddleware, drain_on_signals
from ..http.upstream_client import upstream_client
from ..metrics import Metrics
from ..metrics.engine import EngineCollector
from ..metrics.multiprocess import mark_process_dead
from ..render.render import get_renderer
from ..store.base import Store
from ..store.factory import open_store
from ..store.quota import TenantQuotaStore
from ..store.redis import RedisStore
from . import admin, boundary_route, dashboard, health
from .keys_reload import reload_keys_on_sighup
from .limits import TenantLimits
from .pool_metrics import PoolMetrics
from .served_models import ModelRegistry, load_model_specs
from .settings import ServiceSettings
from .sidecar_host import SidecarHost
from .state import ServiceState
from .tenants import KeysConfig
from .upstream import FirstByte

DESCRIPTION = ("An OpenAI-compatible proxy that attaches the cached SpecPrefill boundary "
               "(specprefill_system_end) of each request. Errors use OpenAI's shape.")
BODY_MODELS = (ChatCompletionRequest, PrefixBoundaryRequest, MessagesRequest, CountTokensRequest,
               ResponsesRequest, PurgeRequest)

# Connections kept to the upstreams: enough for many concurrent streams, bounded all the same.
MAX_UPSTREAM_CONNECTIONS = 512
UPSTREAM_KEEPALIVE_EXPIRY_S = 2.0
RESPONSES_TIMEOUT_S = 1.0  # the longest wait for a stored response in the shared store
KEEP_WARM_SECONDS = 5.0


def open_backing_store(settings: ServiceSettings, n_tenants: int) -> Store:
    """Redis when configured; else memory sized to the sum of the tenants' byte quotas, so
    the quotas, not the store's own LRU, decide what is evicted."""
    if settings.uses_memory_store:
        return open_store(None, max_bytes=n_tenants * settings.tenant_max_bytes)
    try:
        return open_store(settings.redis_url, timeout_seconds=settings.redis_timeout_s,
                          connect_timeout_seconds=settings.redis_connect_timeout_s)
    except ImportError as exc:
        raise ValueError(f"--redis {settings.redis_url}: the Redis store is not available: "
                         f"{exc}") from exc


def open_response_store(settings: ServiceSettings) -> ResponseStore:
    """Stored responses: in the shared store when there is one (any worker or replica finds
    them; Redis alone, no memory tier, so a delete holds everywhere at once), else in this
    worker."""
    if settings.uses_memory_store:
        return MemoryResponses(settings.responses_store_bytes)
    # Its own connections, breaker and a longer wait than a lookup's: a response is data the
    # client needs back, not a cache entry a recompute replaces.
    shared = open_store(settings.redis_url, tiered=False, timeout_seconds=max(
        settings.redis_timeout_s, RESPONSES_TIMEOUT_S),
        connect_timeout_seconds=max(settings.redis_connect_timeout_s, RESPONSES_TIMEOUT_S))
    assert isinstance(shared, RedisStore)  # tiered=False: Redis alone (its guarded put)
    return SharedResponses(shared, max_bytes=settings.responses_store_bytes,
                           ttl_seconds=settings.responses_store_ttl_s)


async def keep_warm(store: Store, connections: int) -> None:
    """Reopen the store's connections every few seconds once errors have dropped some."""
    while True:
        await asyncio.sleep(KEEP_WARM_SECONDS)
        await store.awarm(connections)


def build_state(settings: ServiceSettings, models: ModelRegistry | None = None) -> ServiceState:
    """Everything a worker needs before it takes requests; ValueError on bad configuration."""
    callers = KeysConfig.load(settings)
    keyring = callers.keyring()
    registry = models if models is not None else ModelRegistry.from_specs(load_model_specs(settings))
    for model in registry:
        # The first render of a tokenizer fingerprints its whole vocabulary (once, ~1 s for 150k
        # tokens) on the calling thread: do it now, not on the event loop of a first request.
        get_renderer(model.tokenizer)
    store = TenantQuotaStore(open_backing_store(settings, len(keyring.tenants)),
                             max_entries=settings.tenant_max_entries,
                             max_bytes=settings.tenant_max_bytes)
    metrics = Metrics(max_tenants=settings.metrics_max_tenants)
    engines = [(m.name, m.engine) for m in registry if m.engine is not None]
    if engines:  # in-process engines' own counters, read at scrape time
        metrics.add_collector(EngineCollector(lambda: engines))
    pools = PoolMetrics(metrics)  # per-replica routing metrics of the upstream pools
    for model in registry:
        if model.pool is not None:
            pools.watch(model.name, model.pool)
            model.pool.first_byte = FirstByte(settings.upstream_first_byte_s,
                                              settings.ready_timeout_s)
    cache = StaticPrefixCache(store, observer=metrics,
                              tokenize_check_rate=settings.tokenize_check_rate)
    limits = TenantLimits.from_settings(settings, callers.tenant_limits)
    return ServiceState(settings, registry, keyring, store, cache, metrics, limits,
                        Drain(settings.shutdown_grace_s),
                        responses=open_response_store(settings))


def create_app(settings: ServiceSettings | None = None, *,
               models: ModelRegistry | None = None) -> FastAPI:
    """The app for ``settings`` (default: from the environment); ``models`` skips loading."""
    state = build_state(settings or ServiceSettings(), models)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        s = state.settings
        state.client = upstream_client(
            httpx.Timeout(s.upstream_timeout_s, connect=s.upstream_connect_timeout_s),
            httpx.Limits(max_connections=MAX_UPSTREAM_CONNECTIONS, max_keepalive_connections=64,
                         # Below uvicorn's 5 s keep-alive (and most servers'): reusing a
                         # connection the upstream is closing at that moment is a 502.
                         keepalive_expiry=UPSTREAM_KEEPALIVE_EXPIRY_S))
        # Redis connections made before the first burst, and again after errors dropped them.
        await state.store.awarm(s.redis_warm_connections)
        warm = asyncio.create_task(keep_warm(state.store, s.redis_warm_connections))
        gauges = asyncio.create_task(dashboard.refresh_gauges_forever(state))
        probes = asyncio.create_task(health.probe_forever(state))
        restore_signals = drain_on_signals(state.drain)
        restore_sighup = reload_keys_on_sighup(state)
        # What start made (tokenizers, templates, the app: ~125k objects) lives as long as the
        # app: out of every collection, which then scans only what requests made. Thawed at
        # the end, so an app stopped in a longer-lived process can be collected.
        gc.freeze()
        try:
            yield
        finally:
            gc.unfreeze()
            restore_sighup()
            restore_signals()
            probes.cancel()
            gauges.cancel()
            warm.cancel()
            await state.client.aclose()
            await asyncio.to_thread(state.models.close)  # in-process engines, if any
            await state.store.aclose()  # the loop's Redis connections, closed on their loop
            await state.responses.aclose()
            await state.limits.rates.aclose()
            state.cache.close()
            mark_process_dead()

    # No trailing-slash redirects: Starlette builds their Location from the Host header, which
    # the client chooses. No Swagger page either (it would load scripts from a CDN).
    app = FastAPI(title="prefix-cache sidecar", version=openapi_docs.package_version(),
                  description=DESCRIPTION,
                  lifespan=lifespan, redirect_slashes=False, docs_url=None, redoc_url=None,
                  openapi_url=openapi_docs.OPENAPI_PATH)
    app.state.service = state
    install_error_handlers(app)
    # Outermost last: every response, the drain's 503 included, carries the request id.
    app.add_middleware(DrainMiddleware, drain=state.drain)
    app.add_middleware(RequestIdMiddleware)
    # Outside the drain too: a 503 while draining is an answer an operator wants counted.
    app.add_middleware(RequestRecordMiddleware, on_done=state.metrics.request_done,
                       on_start=state.metrics.request_started)
    mount(app, SidecarHost(state))  # the API routes both servers serve
    for module in (boundary_route, admin, health, dashboard):
        app.include_router(module.router)
    # Routes are matched in order: the sidecar's hot path first, outside FastAPI's routers.
    app.router.routes.insert(0, boundary_route.fast_lane())
    openapi_docs.install(app, BODY_MODELS, bearer_paths=("/v1/", "/admin/", "/metrics"))
    return app
