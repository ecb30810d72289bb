"""What one running sidecar holds: settings, models, keys, store, cache, upstream client."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import httpx

from ..cache.cache import StaticPrefixCache
from ..chat.responses_store import MemoryResponses, ResponseStore
from ..http.drain import Drain
from ..metrics import Metrics
from ..store.quota import TenantQuotaStore
from .limits import TenantLimits
from .served_models import ModelRegistry
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
    # Stored /v1/responses (previous_response_id, GET/DELETE /v1/responses/{id})
    responses: ResponseStore = field(default_factory=MemoryResponses)
    client: httpx.AsyncClient | None = None  # opened by the app's lifespan, on its event loop
    started_at: int = field(default_factory=lambda: int(time.time()))

    @property
    def http(self) -> httpx.AsyncClient:
        if self.client is None:
            raise RuntimeError("the upstream client is not open: the app's lifespan has not run")
        return self.client
