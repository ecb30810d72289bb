"""Tenants for the plug-in inside oMLX's server: the request's API key names its tenant.

oMLX's server checks ``Authorization: Bearer KEY`` or ``x-api-key: KEY`` (its main key and its
sub-keys) and hands the engine no tenant. ``TenantFromKey`` is an ASGI middleware put in front
of oMLX's app; it holds each request's tenant in a context variable, which ``tenant_namespace``
(the ``namespace`` a ``SpecPrefillBoundary`` takes) reads in the engine:

    app.add_middleware(TenantFromKey)                       # omlx.server.app
    install(engine, SpecPrefillBoundary(cache, namespace=tenant_namespace))

Rule: with ``header`` given (say ``x-tenant``, set by a proxy in front that the operator
trusts), its value is the tenant; otherwise the API key is, as ``key-`` and the first 16 hex
digits of its SHA-256 (the key itself never becomes a namespace: namespaces reach logs and
metric labels); no key, no header: ``default``. Entries are never shared across namespaces.
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from contextvars import ContextVar
from typing import Any

DEFAULT = "default"
_TENANT: ContextVar[str] = ContextVar("prefix_cache_omlx_tenant", default=DEFAULT)

Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]],
                   Awaitable[None]]


def key_tenant(key: str) -> str:
    """The tenant an API key names (a digest, never the key)."""
    return "key-" + hashlib.sha256(key.encode("utf-8")).hexdigest()[:16]


def tenant_of(headers: Mapping[str, str], header: str | None = None) -> str:
    """The tenant of a request's headers (lower-case names), by the module's rule."""
    if header is not None:
        return headers.get(header.lower(), "").strip() or DEFAULT
    auth = headers.get("authorization", "")
    key = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
    key = key or headers.get("x-api-key", "").strip()
    return key_tenant(key) if key else DEFAULT


def tenant_namespace(kwargs: Mapping[str, Any] | None = None) -> str:
    """The current request's tenant (a ``SpecPrefillBoundary`` namespace callable)."""
    return _TENANT.get()


class TenantFromKey:
    """ASGI middleware: each HTTP request's tenant, for ``tenant_namespace`` in the engine."""

    def __init__(self, app: ASGIApp, header: str | None = None) -> None:
        self.app = app
        self.header = header

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                   for k, v in scope.get("headers", [])}
        token = _TENANT.set(tenant_of(headers, self.header))
        try:
            await self.app(scope, receive, send)
        finally:
            _TENANT.reset(token)
