"""``/healthz`` (the process is up) and ``/readyz`` (the store and every upstream answer -- for
a pool, any of its replicas, each reported --, every in-process engine is running).

Both are public, as probes need them: the status is for anyone; ``/readyz``'s report (models,
upstreams, store, engines) only for a metrics or admin key, or on an unlocked service."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from ..api import openapi_docs as docs
from ..api.schemas import HealthStatus, ReadyReport
from .deps import State
from .pool import UpstreamPool
from .state import ServiceState

log = logging.getLogger("prefix_cache.service")

router = APIRouter()


@router.get("/healthz", response_model=None, responses=docs.responses(HealthStatus))
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz", responses={**docs.responses(ReadyReport),
                                  503: {"model": ReadyReport, "description": docs.ERRORS[503]}})
async def readyz(request: Request, state: State) -> JSONResponse:
    pools = {m.name: m.pool for m in state.models if m.pool is not None}
    store, report = await asyncio.gather(check_store(state), probe_pools(state, pools))
    # In-process engines report themselves (no I/O: is the engine thread up, how busy it is).
    engines = {m.name: m.engine.health() for m in state.models if m.engine is not None}
    ready = store["ok"] and all(r["ok"] for r in (*report.values(), *engines.values()))
    answer: dict[str, Any] = {"status": "ready" if ready else "not_ready"}
    if state.keyring.may_observe(request.headers.get("authorization")):
        answer.update(store=store, upstreams=report, engines=engines)
    return JSONResponse(answer, status_code=200 if ready else 503)


async def probe_pools(state: ServiceState, pools: dict[str, UpstreamPool]) -> dict[str, Any]:
    """Each pool's report from its replicas' health checks (one per distinct replica, however
    many models share it); a failed one leaves that replica out, a passed one brings it back
    (``UpstreamPool.observe_probes``)."""
    probes = {r.upstream.health_url: r.upstream for p in pools.values() for r in p.replicas}
    timeout = state.settings.ready_timeout_s
    answers = await asyncio.gather(*(u.probe(state.http, timeout) for u in probes.values()))
    by_url = dict(zip(probes, answers, strict=True))
    return {name: pool.observe_probes(by_url) for name, pool in pools.items()}


async def probe_forever(state: ServiceState) -> None:
    """Every ``upstream_probe_interval_s``, the replicas of each pool of several: an ejected
    replica is routed to again within one interval of being back, not when its backoff ends,
    and a stalled one is left out before requests find it."""
    pools = {m.name: m.pool for m in state.models if m.pool is not None and len(m.pool) > 1}
    if not pools:
        return
    while True:
        await asyncio.sleep(state.settings.upstream_probe_interval_s)
        try:
            await probe_pools(state, pools)
        except Exception:  # a probe's failure must never end the probing
            log.exception("the background health probes failed")


async def check_store(state: ServiceState) -> dict[str, Any]:
    """The store answers now: a ping straight to the shared store (never through the circuit
    breaker, which would report an outage until its window ends, long after the store is back);
    an in-process store always answers."""
    backend = state.store.stats().backend
    try:
        ok = await asyncio.wait_for(state.store.aping(), state.settings.ready_timeout_s)
    except TimeoutError:
        ok = False
    return {"ok": True, "backend": backend} if ok else \
        {"ok": False, "backend": backend, "error": "unreachable"}
