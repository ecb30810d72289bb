"""The sidecar service: an OpenAI-compatible proxy that attaches the cached boundary.

``create_app(settings)`` builds the FastAPI app; ``prefix-cache serve`` runs it on uvicorn.
Modules, one concept each: ``settings`` (the one settings model) and ``flags`` (serve's flags
from it), ``models`` (configured models, each served by an upstream or an in-process
``ChatBackend``), ``tenants`` (API keys -> namespaces), ``quota`` (per-tenant entry quotas),
``upstream`` (upstream kinds and calls), ``schemas`` (request bodies), ``config_files``,
``api``/``admin``/``health``/``dashboard`` (routes), ``state``/``deps``/``app`` (wiring),
``server`` (uvicorn). The HTTP plumbing it shares with the engine's server is in
``prefix_cache.http``; the engine seam and the OpenAI layer in ``prefix_cache.chat``.
"""

from .app import create_app
from .settings import ServiceSettings

__all__ = ["ServiceSettings", "create_app"]
