"""``/admin/``: stats and purges, for admin keys only."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request

from ..errors import StoreUnavailableError
from ..http.errors import BadRequest, ServiceUnavailable
from ..keys import key_pattern, model_label, validate_label
from .deps import State, read_body, require_admin
from .schemas import PurgeRequest

router = APIRouter(prefix="/admin", dependencies=[Depends(require_admin)])
PURGE_RETRY_AFTER_S = 5


@router.get("/stats")
async def stats(state: State) -> dict[str, Any]:
    """The cache's counters (the metrics' tally: every worker's, in multiprocess mode) and the
    store's figures, per tenant included."""
    return {
        "cache": state.metrics.snapshot(),
        "store": state.store.stats().as_dict(),
        "tenants": state.keyring.tenants,
        "models": [m.name for m in state.models],
    }


@router.post("/purge")
async def purge(request: Request, state: State) -> dict[str, Any]:
    """Remove every entry of a tenant, of a model, or of a tenant's use of a model."""
    _, body = await read_body(request, state)
    req = PurgeRequest.model_validate(body)
    if req.tenant is None and req.model is None:
        raise BadRequest("give 'tenant', 'model' or both")
    try:
        # A label never holds glob characters, so a purge cannot reach past what it names.
        tenant = validate_label(req.tenant, "tenant") if req.tenant is not None else None
    except ValueError as exc:
        raise BadRequest(str(exc)) from None
    model = model_label(req.model) if req.model is not None else None
    pattern = key_pattern(state.cache.prefix, tenant, model)
    try:
        # The shared tier first, this worker's memory tier only once it succeeded.
        purged = await state.store.apurge(pattern)
    except StoreUnavailableError as exc:
        raise ServiceUnavailable(
            "the shared store is unavailable, so the purge did not complete (this worker's "
            "memory tier was left as it was); retry once the store is back",
            code="store_unavailable", headers={"Retry-After": str(PURGE_RETRY_AFTER_S)}) from exc
    return {"purged": purged, "pattern": pattern}
