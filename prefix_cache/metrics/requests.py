"""Request-level metrics of the API routes (chat completions, Messages, Responses): what a
request cost the platform, by API, model, cache result and tenant, the same whether an
in-process engine or an upstream answered (an upstream's counts come from its usage).

    prefix_cache_http_requests_total{status}         answers, by HTTP status
    prefix_cache_e2e_request_latency_seconds         request in to last byte out (+status)
    prefix_cache_time_to_first_token_seconds         request in to the answer's first content
    prefix_cache_prompt_tokens_total                 prompt tokens
    prefix_cache_prompt_tokens_cached_total          prompt tokens whose KV was reused
    prefix_cache_generation_tokens_total             tokens generated

Every family has the labels ``api``, ``model``, ``cache`` (hit|miss|none) and ``tenant``
(the bounded tenant label; "default" on an open service, "" before a key was checked).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram

from ..http.request_record import RequestRecord
from .children import LabelledChildren

log = logging.getLogger("prefix_cache.metrics")

NS = "prefix_cache"
LABELS = ("api", "model", "cache", "tenant")
E2E_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
               120.0, 300.0)
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                30.0, 60.0)


class RequestMetrics:
    """The six families, and ``observe`` that records one finished request in them."""

    def __init__(self, registry: CollectorRegistry | None,
                 tenant_label: Callable[[str], str]) -> None:
        reg = registry
        self.tenant_label = tenant_label
        self._child = LabelledChildren()
        self.requests = Counter(f"{NS}_http_requests_total", "API requests answered, by HTTP "
                                "status.", [*LABELS, "status"], registry=reg)
        self.latency = Histogram(f"{NS}_e2e_request_latency_seconds", "API request time, in "
                                 "to the last byte out.", [*LABELS, "status"],
                                 buckets=E2E_BUCKETS, registry=reg)
        self.ttft = Histogram(f"{NS}_time_to_first_token_seconds", "API request in to the "
                              "first content byte sent (streamed or not; answers below 400).",
                              list(LABELS), buckets=TTFT_BUCKETS, registry=reg)
        self.prompt = Counter(f"{NS}_prompt_tokens_total", "Prompt tokens of API requests "
                              "answered.", list(LABELS), registry=reg)
        self.cached = Counter(f"{NS}_prompt_tokens_cached_total", "Prompt tokens whose KV "
                              "the engine reused (as the engine or the upstream's usage "
                              "reports).", list(LABELS), registry=reg)
        self.generated = Counter(f"{NS}_generation_tokens_total", "Tokens generated for API "
                                 "requests.", list(LABELS), registry=reg)

    def observe(self, record: RequestRecord) -> None:
        """One finished request, in every family."""
        labels = (record.api, record.model, record.cache, self.tenant_label(record.tenant)
                  if record.tenant else "")
        status = str(record.status or 500)
        self._child(self.requests, *labels, status).inc()
        self._child(self.latency, *labels, status).observe(record.latency_s)
        if record.status >= 400:
            return
        ttft = record.ttft_s
        if ttft is not None:
            self._child(self.ttft, *labels).observe(ttft)
        self._child(self.prompt, *labels).inc(record.prompt_tokens)
        self._child(self.cached, *labels).inc(record.cached_tokens)
        self._child(self.generated, *labels).inc(record.generation_tokens)

