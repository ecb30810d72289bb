"""What one running sidecar holds: settings, models, keys, store, cache, upstream client."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import httpx

from ..cache import StaticPrefixCache
from ..chat.responses_store import ResponseStore
from ..http.shutdown import Drain
from ..metrics import Metrics
from .limits import TenantLimits
from .models import ModelRegistry
from .quota import TenantQuotaStore
from .settings import ServiceSettings
from .tenants import KeyRing


@dataclass
class ServiceState:
    """Shared by every request of one app (one worker)."""

    settings: ServiceSettings
    models: ModelRegistry
    keyring: KeyRing
    store: TenantQuotaStore
    cache: StaticPrefixCache
    metrics: Metrics
    limits: TenantLimits
    drain: Drain
    responses: ResponseStore = field(default_factory=ResponseStore)  # previous_response_id
    client: httpx.AsyncClient | None = None  # opened by the app's lifespan, on its event loop
    started_at: int = field(default_factory=lambda: int(time.time()))

    @property
    def http(self) -> httpx.AsyncClient:
        if self.client is None:
            raise RuntimeError("the upstream client is not open: the app's lifespan has not run")
        return self.client
