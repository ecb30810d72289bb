"""FastAPI dependencies of the shared routes: the host that mounted them, and the caller."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from .host import Host


async def get_host(request: Request) -> Host:
    host: Host = request.app.state.api_host
    return host


HostDep = Annotated[Host, Depends(get_host)]


async def get_caller(request: Request, host: HostDep) -> str:
    """The caller's tenant, from its key (401/403 when it has none or a wrong one)."""
    return host.caller(request)


Caller = Annotated[str, Depends(get_caller)]
