"""Tenants: API keys mapped to cache namespaces, server-side, and admin keys apart from them.

With no tenant keys configured the service is open and every request is in namespace
"default". Keys are held as SHA-256 digests: the lookup compares digests, so neither a timing
side channel nor a memory dump gives the keys themselves away.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from ..http.auth import basic_password, bearer_key
from ..http.errors import Forbidden, Unauthorized
from ..keys import validate_label
from .config_files import read_config_file
from .settings import ServiceSettings

OPEN_NAMESPACE = "default"


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class KeyRing:
    """Who a request is: its tenant (namespace) and whether it may use ``/admin/``."""

    def __init__(self, tenant_keys: Mapping[str, str], admin_keys: Iterable[str] = ()) -> None:
        self._tenants: dict[bytes, str] = {}
        for key, tenant in tenant_keys.items():
            if not key:
                raise ValueError("an API key may not be empty")
            self._tenants[_digest(key)] = validate_label(tenant, "tenant")
        self._admins = {_digest(k) for k in admin_keys if k}

    @classmethod
    def from_settings(cls, settings: ServiceSettings) -> KeyRing:
        """Keys from the keys file, then from ``api_keys``/``admin_keys`` (which win)."""
        tenants: dict[str, str] = {}
        admins: list[str] = []
        if settings.keys_file is not None:
            file_tenants, file_admins = _read_keys_file(settings.keys_file)
            tenants.update(file_tenants)
            admins.extend(file_admins)
        tenants.update(settings.api_keys)
        admins.extend(settings.admin_keys)
        return cls(tenants, admins)

    @property
    def is_open(self) -> bool:
        """No tenant keys: anyone may call /v1, all in namespace "default"."""
        return not self._tenants

    @property
    def tenants(self) -> list[str]:
        """The configured namespaces (just "default" when open)."""
        return sorted(set(self._tenants.values())) if self._tenants else [OPEN_NAMESPACE]

    def tenant_for(self, authorization: str | None) -> str:
        """The namespace of a /v1 request; Unauthorized or Forbidden if it has none."""
        if self.is_open:
            return OPEN_NAMESPACE  # OpenAI clients always send some key: it is not ours to check
        key = bearer_key(authorization)
        if key is None:
            raise Unauthorized("missing API key: send it as 'Authorization: Bearer KEY'")
        digest = _digest(key)
        tenant = self._tenants.get(digest)
        if tenant is not None:
            return tenant
        if digest in self._admins:
            raise Forbidden("this is an admin key, which has no tenant: use a tenant's key for /v1",
                            code="admin_key_has_no_tenant")
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

    def dashboard_cookie(self) -> str:
        """A cookie value any worker can check: an HMAC under an admin key's digest."""
        digest = min(self._admins)
        return hmac.new(digest, b"prefix-cache-dashboard", hashlib.sha256).hexdigest()

    def dashboard_allowed(self, authorization: str | None, cookie: str | None) -> bool:
        """Open when no admin key is configured; else an admin key as Bearer, as the Basic-auth
        password (what a browser's login prompt sends), or the dashboard cookie."""
        if not self._admins:
            return True
        if cookie:
            for digest in self._admins:
                good = hmac.new(digest, b"prefix-cache-dashboard", hashlib.sha256).hexdigest()
                if hmac.compare_digest(good, cookie):
                    return True
        key = bearer_key(authorization) or basic_password(authorization)
        return key is not None and _digest(key) in self._admins


def _read_keys_file(path: Path) -> tuple[dict[str, str], list[str]]:
    data = read_config_file(path, "keys file")
    unknown = set(data) - {"tenants", "admin_keys"}
    if unknown:
        raise ValueError(f"keys file {str(path)!r}: unknown fields {sorted(unknown)}; "
                         "expected 'tenants' and 'admin_keys'")
    tenants: Any = data.get("tenants") or {}
    admins: Any = data.get("admin_keys") or []
    if not isinstance(tenants, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in tenants.items()
    ):
        raise ValueError(f"keys file {str(path)!r}: 'tenants' must map API keys to tenant names")
    if not isinstance(admins, list) or not all(isinstance(k, str) for k in admins):
        raise ValueError(f"keys file {str(path)!r}: 'admin_keys' must be a list of keys")
    return tenants, admins
