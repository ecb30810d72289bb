"""Tenants: API keys mapped to cache namespaces, server-side; admin and metrics keys apart.

With no tenant keys configured the service is open and every request is in namespace
"default". What is public is decided here (docs/security.md): ``/healthz`` and ``/readyz``'s
status always; with no key of any kind configured everything else too; once any key exists,
``/metrics`` and ``/readyz``'s details need a metrics or admin key and the dashboard an admin
key. Keys are held as SHA-256 digests: the lookup compares digests, so neither a timing side
channel nor a memory dump gives the keys themselves away.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from ..cache.keys import validate_label
from ..errors import validation_problems
from ..http.auth import BEARER_HINT, basic_password, bearer_key
from ..http.errors import Forbidden, Unauthorized
from .config_files import read_config_file
from .limits import TenantLimitOverride
from .settings import ServiceSettings

OPEN_NAMESPACE = "default"
DASHBOARD_COOKIE_TTL_S = 12 * 3600  # a working day's login; then the prompt again


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class KeyRing:
    """Who a request is: its tenant (namespace), and whether it may use ``/admin/`` or read
    operational data (``/metrics``, ``/readyz``'s report)."""

    def __init__(self, tenant_keys: Mapping[str, str], admin_keys: Iterable[str] = (),
                 metrics_keys: Iterable[str] = ()) -> None:
        self._tenants: dict[bytes, str] = {}
        for key, tenant in tenant_keys.items():
            if not key:
                raise ValueError("an API key may not be empty")
            self._tenants[_digest(key)] = validate_label(tenant, "tenant")
        self._admins = {_digest(k) for k in admin_keys if k}
        self._observers = {_digest(k) for k in metrics_keys if k} | self._admins

    @classmethod
    def from_settings(cls, settings: ServiceSettings) -> KeyRing:
        """Keys from the keys file, then from the settings (whose tenant keys win)."""
        return KeysConfig.load(settings).keyring()

    @property
    def is_open(self) -> bool:
        """No tenant keys: anyone may call /v1, all in namespace "default"."""
        return not self._tenants

    @property
    def tenants(self) -> list[str]:
        """The configured namespaces (just "default" when open)."""
        return sorted(set(self._tenants.values())) if self._tenants else [OPEN_NAMESPACE]

    def tenant_for(self, authorization: str | None, send_as: str = BEARER_HINT) -> str:
        """The namespace of a /v1 request; Unauthorized or Forbidden if it has none (the 401
        tells how to send a key: ``send_as``, in the caller's API's terms)."""
        if self.is_open:
            return OPEN_NAMESPACE  # OpenAI clients always send some key: it is not ours to check
        key = bearer_key(authorization)
        if key is None:
            raise Unauthorized(f"missing API key: send it as {send_as}")
        digest = _digest(key)
        tenant = self._tenants.get(digest)
        if tenant is not None:
            return tenant
        if digest in self._admins:
            raise Forbidden("this is an admin key, which has no tenant: use a tenant's key for /v1",
                            code="admin_key_has_no_tenant")
        raise Unauthorized("invalid API key")

    @property
    def is_unlocked(self) -> bool:
        """No key of any kind: a service on a trusted network, every endpoint open."""
        return not (self._tenants or self._observers)

    def may_observe(self, authorization: str | None) -> bool:
        """Whether the caller may read operational data (``/metrics``, ``/readyz`` details):
        anyone on an unlocked service, else the holder of a metrics or admin key."""
        if self.is_unlocked:
            return True
        key = bearer_key(authorization)
        return key is not None and _digest(key) in self._observers

    def require_observer(self, authorization: str | None) -> None:
        """Pass when ``may_observe``; else Unauthorized (no or unknown key) or Forbidden."""
        if self.may_observe(authorization):
            return
        if not self._observers:
            raise Forbidden("metrics are disabled: tenants' names and traffic are not public "
                            "once keys exist; configure a metrics key (PREFIX_CACHE_METRICS_KEYS"
                            " or metrics_keys in the keys file) or an admin key",
                            code="metrics_disabled")
        key = bearer_key(authorization)
        if key is None:
            raise Unauthorized("missing metrics key: send it as 'Authorization: Bearer KEY'")
        if _digest(key) in self._tenants:
            raise Forbidden("a tenant key cannot read metrics: use a metrics or admin key",
                            code="metrics_key_required")
        raise Unauthorized("invalid API key")

    def require_admin(self, authorization: str | None) -> None:
        """Pass for an admin key; Unauthorized (none or unknown) or Forbidden (not admin)."""
        if not self._admins:
            raise Forbidden("admin endpoints are disabled: no admin keys are configured "
                            "(PREFIX_CACHE_ADMIN_KEYS or admin_keys in the keys file)",
                            code="admin_disabled")
        key = bearer_key(authorization)
        if key is None:
            raise Unauthorized("missing admin key: send it as 'Authorization: Bearer KEY'")
        digest = _digest(key)
        if digest in self._admins:
            return
        if digest in self._tenants:
            raise Forbidden("this key is not an admin key", code="admin_key_required")
        raise Unauthorized("invalid API key")


    # -- the dashboard: a browser page, so Basic auth and a cookie besides Bearer ---------------

    @property
    def has_admins(self) -> bool:
        return bool(self._admins)

    def dashboard_cookie(self, now: float | None = None) -> str:
        """A cookie value any worker can check until it expires (``DASHBOARD_COOKIE_TTL_S``
        from ``now``): its expiry time and an HMAC of it under an admin key's digest."""
        expires = str(int((time.time() if now is None else now) + DASHBOARD_COOKIE_TTL_S))
        return f"{expires}.{_cookie_mac(min(self._admins), expires)}"

    def dashboard_allowed(self, authorization: str | None, cookie: str | None,
                          now: float | None = None) -> bool:
        """Open on an unlocked service; else an admin key as Bearer, as the Basic-auth
        password (what a browser's login prompt sends), or an unexpired dashboard cookie."""
        if self.is_unlocked:
            return True
        if cookie and self._cookie_valid(cookie, time.time() if now is None else now):
            return True
        key = bearer_key(authorization) or basic_password(authorization)
        return key is not None and _digest(key) in self._admins

    def _cookie_valid(self, cookie: str, now: float) -> bool:
        expires, _, mac = cookie.partition(".")
        if not expires.isdigit() or not now < int(expires) <= now + DASHBOARD_COOKIE_TTL_S:
            return False
        # Any admin key's: a removed key's cookies end with it (on SIGHUP's re-read).
        return any(hmac.compare_digest(_cookie_mac(digest, expires), mac)
                   for digest in self._admins)


def _cookie_mac(digest: bytes, expires: str) -> str:
    return hmac.new(digest, b"prefix-cache-dashboard:" + expires.encode(), hashlib.sha256
                    ).hexdigest()


KEYS_FILE_FIELDS = ("tenants", "admin_keys", "metrics_keys", "tenant_limits")


@dataclass
class KeysConfig:
    """Everything about callers: keys by kind and per-tenant limits, from the keys file and the
    settings (whose ``api_keys`` win over the file's tenants; key lists add up)."""

    tenants: dict[str, str] = field(default_factory=dict)
    admin_keys: list[str] = field(default_factory=list)
    metrics_keys: list[str] = field(default_factory=list)
    tenant_limits: dict[str, TenantLimitOverride] = field(default_factory=dict)

    @classmethod
    def load(cls, settings: ServiceSettings) -> KeysConfig:
        config = cls() if settings.keys_file is None else _read_keys_file(settings.keys_file)
        config.tenants.update(settings.api_keys)
        config.admin_keys.extend(settings.admin_keys)
        config.metrics_keys.extend(settings.metrics_keys)
        known = set(config.tenants.values()) or {OPEN_NAMESPACE}
        unknown = sorted(set(config.tenant_limits) - known)
        if unknown:
            raise ValueError(f"tenant_limits names {unknown}, which no API key maps to "
                             f"(tenants: {sorted(known)})")
        return config

    def keyring(self) -> KeyRing:
        return KeyRing(self.tenants, self.admin_keys, self.metrics_keys)


def _read_keys_file(path: Path) -> KeysConfig:
    data = read_config_file(path, "keys file")
    where = f"keys file {str(path)!r}"
    unknown = set(data) - set(KEYS_FILE_FIELDS)
    if unknown:
        raise ValueError(f"{where}: unknown fields {sorted(unknown)}; expected "
                         + ", ".join(repr(f) for f in KEYS_FILE_FIELDS))
    tenants: Any = data.get("tenants") or {}
    if not isinstance(tenants, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in tenants.items()
    ):
        raise ValueError(f"{where}: 'tenants' must map API keys to tenant names")
    lists = {}
    for name in ("admin_keys", "metrics_keys"):
        keys: Any = data.get(name) or []
        if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
            raise ValueError(f"{where}: {name!r} must be a list of keys")
        lists[name] = keys
    limits: Any = data.get("tenant_limits") or {}
    if not isinstance(limits, dict):
        raise ValueError(f"{where}: 'tenant_limits' must map tenant names to their limits")
    overrides = {}
    for tenant, entry in limits.items():
        try:
            overrides[str(tenant)] = TenantLimitOverride.model_validate(entry)
        except ValidationError as exc:
            problems = validation_problems(exc, "limits")
            raise ValueError(f"{where}: tenant_limits of {tenant!r}: {problems}") from None
    if not (tenants or lists["admin_keys"] or lists["metrics_keys"] or overrides):
        # Empty, or cut short (``tenants:`` alone reads as none): never taken as "run open".
        raise ValueError(f"{where} holds no key (empty, or cut short?); to run open, start "
                         "without a keys file")
    return KeysConfig(dict(tenants), lists["admin_keys"], lists["metrics_keys"], overrides)
