"""FastAPI dependencies of the sidecar's own routes: its state, its host, the admin check."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from .sidecar_host import SidecarHost
from .state import ServiceState


async def get_state(request: Request) -> ServiceState:
    state: ServiceState = request.app.state.service
    return state


State = Annotated[ServiceState, Depends(get_state)]


async def get_sidecar(request: Request) -> SidecarHost:
    host: SidecarHost = request.app.state.api_host
    return host


Sidecar = Annotated[SidecarHost, Depends(get_sidecar)]


async def require_admin(request: Request, state: State) -> None:
    """Pass for admin keys only (401/403 otherwise)."""
    state.keyring.require_admin(request.headers.get("authorization"))
