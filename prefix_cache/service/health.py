"""``/healthz`` (the process is up) and ``/readyz`` (the store and every upstream answer -- for
a pool, any of its replicas, each reported --, every in-process engine is running).

Both are public, as probes need them: the status is for anyone; ``/readyz``'s report (models,
upstreams, store, engines) only for a metrics or admin key, or on an unlocked service."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from ..api import openapi_docs as docs
from ..api.schemas import HealthStatus, ReadyReport
from .deps import State
from .state import ServiceState

router = APIRouter()


@router.get("/healthz", response_model=None, responses=docs.responses(HealthStatus))
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz", responses={**docs.responses(ReadyReport),
                                  503: {"model": ReadyReport, "description": docs.ERRORS[503]}})
async def readyz(request: Request, state: State) -> JSONResponse:
    pools = {m.name: m.pool for m in state.models if m.pool is not None}
    # One probe per distinct replica, however many models share it.
    probes = {r.upstream.health_url: r.upstream for p in pools.values() for r in p.replicas}
    timeout = state.settings.ready_timeout_s
    store, *answers = await asyncio.gather(
        check_store(state),
        *(u.probe(state.http, timeout) for u in probes.values()),
    )
    by_url = dict(zip(probes, answers, strict=True))
    # Each pool reads its replicas' answers (a failed one leaves that replica out: pool.py).
    report = {name: pool.observe_probes(by_url) for name, pool in pools.items()}
    # In-process engines report themselves (no I/O: is the engine thread up, how busy it is).
    engines = {m.name: m.engine.health() for m in state.models if m.engine is not None}
    ready = store["ok"] and all(r["ok"] for r in (*report.values(), *engines.values()))
    answer: dict[str, Any] = {"status": "ready" if ready else "not_ready"}
    if state.keyring.may_observe(request.headers.get("authorization")):
        answer.update(store=store, upstreams=report, engines=engines)
    return JSONResponse(answer, status_code=200 if ready else 503)


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
