"""FastAPI dependencies: the service state, the caller's tenant, the admin check."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Depends, Request

from ..http.auth import client_authorization, key_hint
from ..http.body import read_json_object
from .state import ServiceState

MAX_BODY_SETTING = "PREFIX_CACHE_MAX_BODY_BYTES"


async def get_state(request: Request) -> ServiceState:
    state: ServiceState = request.app.state.service
    return state


State = Annotated[ServiceState, Depends(get_state)]


async def get_tenant(request: Request, state: State) -> str:
    """The caller's namespace, from its API key (401/403 if it has none)."""
    return state.keyring.tenant_for(client_authorization(request.headers.get("authorization"),
                                                         request.headers.get("x-api-key")),
                                    key_hint(request.url.path))


Tenant = Annotated[str, Depends(get_tenant)]


async def read_body(request: Request, state: ServiceState) -> tuple[bytes, dict[str, Any]]:
    """The raw JSON body and its object, under the configured size limit."""
    return await read_json_object(request, state.settings.max_body_bytes, MAX_BODY_SETTING)


async def require_admin(request: Request, state: State) -> None:
    """Pass for admin keys only (401/403 otherwise)."""
    state.keyring.require_admin(request.headers.get("authorization"))
