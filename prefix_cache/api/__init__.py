"""The HTTP API layer both servers mount: the OpenAI chat completions, Anthropic Messages and
OpenAI Responses routes, each written once over a ``Host`` (what differs between the sidecar
and the engine server) and the one pipeline of ``pipeline.py``."""

from __future__ import annotations

from fastapi import FastAPI

from . import chat_routes, messages_routes, responses_routes
from .host import Host


def mount(app: FastAPI, host: Host) -> None:
    """Serve the shared API routes on ``app``, answered by ``host``."""
    app.state.api_host = host
    for module in (chat_routes, messages_routes, responses_routes):
        app.include_router(module.router)
