"""The HTTP API layer both servers mount: the OpenAI chat completions, Anthropic Messages and
OpenAI Responses routes, each written once over a ``Host`` (what differs between the sidecar
and the engine server) and the one pipeline of ``pipeline.py``.

``host.py`` (the ``Host`` and ``Target`` seam), ``pipeline.py`` (the one way from body to answer),
the routes ``chat_routes.py``, ``messages_routes.py``, ``responses_routes.py``, ``deps.py``
(their dependencies), ``engine_target.py`` (an in-process engine as a model's target),
``schemas.py`` (bodies and the documented responses), ``openapi_docs.py`` (``/openapi.json``).
"""

from __future__ import annotations

from fastapi import FastAPI

from . import chat_routes, messages_routes, responses_routes
from .host import Host


def mount(app: FastAPI, host: Host) -> None:
    """Serve the shared API routes on ``app``, answered by ``host``."""
    app.state.api_host = host
    for module in (chat_routes, messages_routes, responses_routes):
        app.include_router(module.router)
