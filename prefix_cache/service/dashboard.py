"""``GET /metrics`` (Prometheus), ``GET /dashboard`` (a live page) and its JSON stats.

The page and its stats need an admin key once any key is configured: as Bearer, or as the
password of the browser's Basic-auth prompt; the page then sets a cookie so its own polling is
authenticated. ``/metrics`` names tenants and their traffic, so once any key is configured it
needs a metrics or admin key as Bearer (Prometheus sends one: ``authorization`` in a scrape
config, ``authorization``/``bearerTokenSecret`` in a ServiceMonitor).
"""

from __future__ import annotations

import asyncio
import math
from importlib import resources
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, PlainTextResponse, Response

from ..api import openapi_docs as docs
from ..api.schemas import DashboardHistory, DashboardStats
from ..http.errors import BadRequest
from ..metrics.history_series import history_document
from .deps import State
from .state import ServiceState
from .tenants import DASHBOARD_COOKIE_TTL_S

router = APIRouter()

COOKIE = "prefix_cache_dashboard"
GAUGE_REFRESH_SECONDS = 2.0
HISTORY_DEFAULT_S = 3600.0
_STATIC = resources.files("prefix_cache").joinpath("static")
_PAGE = _STATIC.joinpath("dashboard.html")
# The vendored chart library (uPlot, MIT: static/uplot/LICENSE), served with the page.
_ASSETS = {"uPlot.iife.min.js": "application/javascript", "uPlot.min.css": "text/css"}


def _challenge() -> Response:
    return Response(
        b'{"error": {"message": "the dashboard needs an admin key (Bearer, or as the password '
        b'of the login prompt)", "type": "invalid_request_error", "code": "invalid_api_key"}}',
        status_code=401, media_type="application/json",
        headers={"WWW-Authenticate": 'Basic realm="prefix-cache dashboard", charset="UTF-8"'},
    )


def _allowed(request: Request, state: ServiceState) -> bool:
    return state.keyring.dashboard_allowed(request.headers.get("authorization"),
                                           request.cookies.get(COOKIE))


def refresh_gauges(state: ServiceState) -> None:
    state.metrics.refresh_store(state.store.stats())
    samples = {}
    for row in engine_rows(state):  # the engines' KV tiers, for the history's charts
        kv, conv, disk = (row.get(k) or {} for k in ("kv_store", "conversation_store", "kv_disk"))
        samples[row["model"]] = [
            kv.get("bytes", 0) + conv.get("bytes", 0), disk.get("bytes", 0),
            kv.get("hits", 0) + conv.get("hits", 0) + disk.get("hits", 0),
            kv.get("evictions", 0) + conv.get("evictions", 0)]
    if samples:
        state.metrics.history.sample_engines(samples)
    state.metrics.history.write()


async def refresh_gauges_forever(state: ServiceState) -> None:
    """Keep this worker's store gauges current, so a scrape answered by any worker is right."""
    while True:
        try:
            refresh_gauges(state)
        except Exception:  # metrics must never take the worker down
            pass
        await asyncio.sleep(GAUGE_REFRESH_SECONDS)


@router.get("/metrics", response_class=PlainTextResponse,
            responses=docs.responses(None, 401, 403, description="Prometheus text format"))
async def metrics(request: Request, state: State) -> Response:
    state.keyring.require_observer(request.headers.get("authorization"))
    refresh_gauges(state)
    body, content_type = state.metrics.exposition()
    return Response(body, media_type=content_type)


@router.get("/dashboard", response_class=HTMLResponse, responses=docs.responses(None, 401))
async def dashboard(request: Request, state: State) -> Response:
    if not _allowed(request, state):
        return _challenge()
    page = HTMLResponse(_PAGE.read_text(encoding="utf-8"),
                        headers={"Cache-Control": "no-store"})
    if state.keyring.has_admins:
        # Expires in the browser and, as the value carries its expiry, on the server too.
        page.set_cookie(COOKIE, state.keyring.dashboard_cookie(), httponly=True,
                        samesite="strict", path="/dashboard", max_age=DASHBOARD_COOKIE_TTL_S)
    return page


@router.get("/dashboard/assets/{name}", include_in_schema=False)
async def dashboard_asset(name: str, request: Request, state: State) -> Response:
    if not _allowed(request, state):
        return _challenge()
    media = _ASSETS.get(name)
    if media is None:
        return Response(status_code=404)
    return Response(_STATIC.joinpath("uplot", name).read_bytes(), media_type=media,
                    headers={"Cache-Control": "max-age=3600"})


async def stats_document(state: ServiceState) -> dict[str, Any]:
    """What the page draws: the metrics summary, store health and in-process engines' counters,
    from this worker's view. "reachable" is a ping of the store now, not the breaker's memory."""
    store = state.store.stats()
    state.metrics.refresh_store(store)
    breaker = store.remote.breaker if store.remote is not None else None
    try:
        reachable = await asyncio.wait_for(state.store.aping(), state.settings.ready_timeout_s)
    except TimeoutError:
        reachable = False
    return {
        "metrics": state.metrics.snapshot(),
        "store_backend": store.backend,
        "store_health": {"breaker": breaker, "reachable": reachable},
        "models": [m.name for m in state.models],
        "engines": engine_rows(state),
        "upstream_replicas": replica_rows(state),
    }


def replica_rows(state: ServiceState) -> list[dict[str, Any]]:
    """``{"model": name, "policy": ..., **replica}`` per upstream replica of every model (this
    worker's counts: requests by routing choice, in flight, ejected, ejections, retries)."""
    return [{"model": m.name, "policy": m.pool.policy, **row}
            for m in state.models if m.pool is not None for row in m.pool.snapshot()]


def engine_rows(state: ServiceState) -> list[dict[str, Any]]:
    """``{"model": name, **stats}`` per in-process engine (none behind an upstream).
    An engine that cannot answer is left out: the page must draw whatever else it has."""
    rows = []
    for m in state.models:
        if m.engine is None:
            continue
        try:
            rows.append({"model": m.name, **m.engine.snapshot_stats().as_dict()})
        except Exception:
            continue
    return rows


@router.get("/dashboard/history.json", responses=docs.responses(DashboardHistory, 400, 401))
async def dashboard_history(request: Request, state: State,
                            seconds: float = HISTORY_DEFAULT_S) -> Response:
    """The service's history (every worker's), ``seconds`` back: series of [unix_time, value]."""
    if not _allowed(request, state):
        return _challenge()
    if not math.isfinite(seconds) or seconds <= 0:
        raise BadRequest(f"seconds must be a positive number, got {seconds!r}",
                         code="invalid_seconds")
    import orjson

    document = await asyncio.to_thread(history_document, state.metrics.history, seconds)
    return Response(orjson.dumps(document), media_type="application/json",
                    headers={"Cache-Control": "no-store"})


@router.get("/dashboard/stats.json", responses=docs.responses(DashboardStats, 401))
async def dashboard_stats(request: Request, state: State) -> Response:
    if not _allowed(request, state):
        return _challenge()
    import orjson

    return Response(orjson.dumps(await stats_document(state)), media_type="application/json",
                    headers={"Cache-Control": "no-store"})
