"""The sidecar service: an OpenAI-compatible proxy that attaches the cached boundary.

``create_app(settings)`` builds the FastAPI app; ``prefix-cache serve`` runs it on uvicorn.
Modules, one concept each: ``settings.py`` (the one settings model of both servers) and
``flags.py`` (their flags from it), ``config_files.py`` (the YAML/JSON files), ``served_models.py``
(configured models: tokenizer, template, where completions go), ``sidecar_host.py`` (the API
layer's host: callers by key, boundaries from the cache), ``proxy_target.py`` (an upstream as a
model's target), ``upstream.py`` (upstream kinds and calls), ``pool.py`` (a model's replicas:
health, ejection, one retry), ``routing.py`` (the routing policies, pure), ``session_hint.py`` (an agent
client's session id, a routing hint), ``pool_metrics.py``,
``tenants.py`` (API keys -> namespaces), ``limits.py`` (per-tenant concurrency and prompt size),
``rate_limits.py`` (requests and tokens per minute), ``keys_reload.py`` (the keys file re-read on
SIGHUP), its own routes ``boundary_route.py`` ``admin.py`` ``health.py`` ``dashboard.py``, wiring
``state.py`` ``deps.py`` ``app.py``, and ``server.py`` (uvicorn). The HTTP plumbing it shares with
the engine's server is in ``prefix_cache.http``, the routes both mount in ``prefix_cache.api``.
"""

from .app import create_app
from .settings import ServiceSettings

__all__ = ["ServiceSettings", "create_app"]
