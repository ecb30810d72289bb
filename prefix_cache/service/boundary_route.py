"""``POST /v1/prefix/boundary``: the boundary itself, the sidecar's own endpoint."""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response

from ..api import openapi_docs as docs
from ..api.deps import Caller
from ..api.schemas import BoundaryRequest, BoundaryResponse, PrefixBoundaryRequest
from ..chat.render_fields import chat_conversation
from .deps import Sidecar, State
from .sidecar_host import cache_headers

router = APIRouter()


@router.post("/v1/prefix/boundary", openapi_extra=docs.json_body(PrefixBoundaryRequest),
             responses=docs.responses(BoundaryResponse, *docs.PREPARE_ERRORS,
                                      headers=docs.CACHE_HEADERS))
async def prefix_boundary(request: Request, state: State, host: Sidecar,
                          tenant: Caller) -> Response:
    async with state.limits.slot(tenant):  # the tenant's share of this worker
        raw, body = await host.read_body(request)
        req = BoundaryRequest.model_validate(body)
        # Prompt ids the client sends are the ids the boundary is cut against (no render).
        result = await host.resolve(state.models.get(req.model), tenant,
                                    chat_conversation(body), len(raw), body.get("prompt_ids"))
    out: dict[str, Any] = {
        "specprefill_system_end": result.specprefill_system_end,
        "prompt_tokens": result.prompt_tokens,
        "cache": result.cache,
        "key": result.key,
    }
    if req.return_prompt_ids:
        out["prompt_ids"] = result.prompt_ids
    return Response(orjson.dumps(out), media_type="application/json",
                    headers=cache_headers(result))
