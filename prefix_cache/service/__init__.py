"""The sidecar service: an OpenAI-compatible proxy that attaches the cached boundary.

``create_app(settings)`` builds the FastAPI app; ``prefix-cache serve`` runs it on uvicorn.
Modules, one concept each: ``settings`` (the one settings model), ``models`` (configured
models), ``tenants`` (API keys -> namespaces), ``quota`` (per-tenant entry quotas),
``upstream`` (upstream kinds and calls), ``relay`` (streaming and disconnects), ``body`` and
``schemas`` (request bodies), ``errors`` (every error -> an OpenAI-shaped response),
``api``/``admin``/``health`` (routes), ``state``/``deps``/``app`` (wiring), ``server`` (uvicorn).
"""

from .app import create_app
from .settings import ServiceSettings

__all__ = ["ServiceSettings", "create_app"]
