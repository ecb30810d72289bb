"""FastAPI dependencies: the service state, the caller's tenant, the admin check."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from .state import ServiceState


async def get_state(request: Request) -> ServiceState:
    state: ServiceState = request.app.state.service
    return state


State = Annotated[ServiceState, Depends(get_state)]


async def get_tenant(request: Request, state: State) -> str:
    """The caller's namespace, from its API key (401/403 if it has none)."""
    return state.keyring.tenant_for(request.headers.get("authorization"))


Tenant = Annotated[str, Depends(get_tenant)]


async def require_admin(request: Request, state: State) -> None:
    """Pass for admin keys only (401/403 otherwise)."""
    state.keyring.require_admin(request.headers.get("authorization"))
