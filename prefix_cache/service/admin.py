"""``/admin/``: stats and purges, for admin keys only."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from fastapi import APIRouter, Depends, Request

from ..api import openapi_docs as docs
from ..api.schemas import AdminStats, PurgeRequest, PurgeResponse
from ..cache.keys import key_pattern, validate_label
from ..errors import StoreUnavailableError
from ..http.errors import BadRequest, ServiceUnavailable
from .deps import Sidecar, State, require_admin
from .state import ServiceState

router = APIRouter(prefix="/admin", dependencies=[Depends(require_admin)])
PURGE_RETRY_AFTER_S = 5
UPSTREAM_PURGE_TIMEOUT_S = 30.0  # deleting a tenant's KV files takes a while on a large tier
log = logging.getLogger("prefix_cache.service")


@router.get("/stats", response_model=None,
            responses=docs.responses(AdminStats, 401, 403))
async def stats(state: State) -> dict[str, Any]:
    """The cache's counters (the metrics' tally: every worker's, in multiprocess mode), the
    store's figures, and each tenant's usage, per tenant included."""
    cache = state.metrics.snapshot()
    return {
        "cache": cache,
        "store": state.store.stats().as_dict(),
        "tenants": state.keyring.tenants,
        "models": [m.name for m in state.models],
        "usage": cache["usage"],
    }


@router.post("/purge", response_model=None, openapi_extra=docs.json_body(PurgeRequest),
             responses=docs.responses(PurgeResponse, 400, 401, 403, 413, 415, 503))
async def purge(request: Request, state: State, host: Sidecar) -> dict[str, Any]:
    """Remove every entry of a tenant, of a model, or of a tenant's use of a model: in the
    store, in-process engines and every replica of an engine upstream (``specprefill``)."""
    body = (await host.read_body(request, ":admin")).data  # no tenant's scope
    req = PurgeRequest.model_validate(body)
    if req.tenant is None and req.model is None:
        raise BadRequest("give 'tenant', 'model' or both")
    try:
        # A label never holds glob characters, so a purge cannot reach past what it names.
        tenant = validate_label(req.tenant, "tenant") if req.tenant is not None else None
        model = purged_model_label(state, req.model) if req.model is not None else None
    except ValueError as exc:
        raise BadRequest(str(exc), code="invalid_label") from None
    pattern = key_pattern(state.cache.prefix, tenant, model)
    try:
        # The shared tier first, this worker's memory tier only once it succeeded.
        purged = await state.store.apurge(pattern)
    except StoreUnavailableError as exc:
        raise ServiceUnavailable(
            "the shared store is unavailable, so the purge did not complete (this worker's "
            "memory tier was left as it was); retry once the store is back",
            code="store_unavailable", headers={"Retry-After": str(PURGE_RETRY_AFTER_S)}) from exc
    await purge_engine_kv(state, tenant, req.model)
    if tenant is not None:
        await state.responses.purge(tenant)  # its stored /v1/responses, every model's
    await purge_upstreams(state, tenant, req.model)
    return {"purged": purged, "pattern": pattern}


async def purge_upstreams(state: ServiceState, tenant: str | None, model: str | None) -> None:
    """The same purge on every replica of every engine upstream in scope (their KV in RAM and on
    disk, their stored responses); ServiceUnavailable naming how many did not confirm it, so
    the operator retries (a purge is idempotent) instead of believing it done."""
    replicas = {r.upstream.purge_url: r.upstream for served in state.models
                if served.pool is not None and (model is None or served.name == model)
                for r in served.pool.replicas if r.upstream.purges}
    answers = await asyncio.gather(*(u.purge(state.http, tenant, UPSTREAM_PURGE_TIMEOUT_S)
                                     for u in replicas.values()))
    failed = {url: why for url, why in zip(replicas, answers, strict=True) if why is not None}
    for url, why in failed.items():
        log.warning("the purge did not reach upstream %s: %s", url, why)
    if failed:
        raise ServiceUnavailable(
            f"{len(failed)} of {len(replicas)} engine upstreams did not confirm the purge "
            "(the sidecar's entries are gone); retry once they are back",
            code="upstream_purge_incomplete",
            headers={"Retry-After": str(PURGE_RETRY_AFTER_S)})


async def purge_engine_kv(state: ServiceState, tenant: str | None, model: str | None) -> None:
    """The in-process engines' KV of the tenant (its namespace; None: every one), in RAM and
    on disk, for the named model or all: what the tenant sent must not outlive its purge."""
    for served in state.models:
        purge = getattr(served.engine, "purge_kv", None)
        if purge is not None and (model is None or served.name == model):
            await asyncio.to_thread(purge, tenant)


def purged_model_label(state: ServiceState, model: str) -> str:
    """The key label of a served model's name, or ``model`` itself if it is a valid label
    (entries of a model no longer served, in a shared store); ValueError otherwise. Never a
    rewrite: a name like "../../demo" would otherwise purge "demo" for every tenant."""
    for served in state.models:
        if served.name == model:
            return served.label
    return validate_label(model, "model")
