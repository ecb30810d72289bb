"""Request-level metrics of the API routes (chat completions, Messages, Responses): what a
request cost the platform, by API, model, cache result and tenant, the same whether an
in-process engine or an upstream answered (an upstream's counts come from its usage).

    prefix_cache_http_requests_total{status}         answers, by HTTP status
    prefix_cache_e2e_request_latency_seconds         request in to last byte out (+status)
    prefix_cache_time_to_first_token_seconds         request in to the answer's first content
    prefix_cache_prompt_tokens_total                 prompt tokens
    prefix_cache_prompt_tokens_cached_total          prompt tokens whose KV was reused
    prefix_cache_generation_tokens_total             tokens generated

and, named as vLLM names them after the prefix (what dashboards and alerts already use):

    prefix_cache_num_requests_waiting                API requests in, not yet handed to their
                                                     engine or upstream (gauge)
    prefix_cache_num_requests_running                handed to it, answer not yet ended (gauge)
    prefix_cache_request_queue_time_seconds          request in to handed to the engine
    prefix_cache_request_prefill_time_seconds        handed to the engine to prompt prefilled
    prefix_cache_request_decode_time_seconds         prefill's end to the last content
    prefix_cache_inter_token_latency_seconds         between two pieces of content
    prefix_cache_request_success_total{finished_reason}  answers that ended: stop, length,
                                                     tool_calls, or abort (cut before an end)

Every histogram and counter has the labels ``api``, ``model``, ``cache`` (hit|miss|none) and
``tenant`` (the bounded tenant label; "default" on an open service, "" before a key was
checked). Latency buckets reach vLLM's largest (2,560 s for TTFT, 7,680 s end to end): a miss
under load can take minutes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ..http.request_record import RequestRecord
from .children import LabelledChildren

log = logging.getLogger("prefix_cache.metrics")

NS = "prefix_cache"
LABELS = ("api", "model", "cache", "tenant")
# Ours at the low end (a hit through the sidecar takes milliseconds), vLLM's at the high end.
E2E_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
               0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
FINISHED_REASONS = ("stop", "length", "tool_calls", "abort")


class RequestMetrics:
    """The request families, ``observe`` that records one finished request in them, and the
    two gauges ``arrived``, ``dispatched`` and ``observe`` keep."""

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
        self.waiting = Gauge(f"{NS}_num_requests_waiting", "API requests in, not yet handed to "
                             "their engine or upstream.", registry=reg,
                             multiprocess_mode="livesum")
        self.running = Gauge(f"{NS}_num_requests_running", "API requests handed to their engine "
                             "or upstream whose answer has not ended.", registry=reg,
                             multiprocess_mode="livesum")
        self.queue = Histogram(f"{NS}_request_queue_time_seconds", "API request in to handed "
                               "to its engine or upstream (tenant queue, boundary).",
                               list(LABELS), buckets=E2E_BUCKETS, registry=reg)
        self.prefill = Histogram(f"{NS}_request_prefill_time_seconds", "Handed to the engine to "
                                 "its prompt prefilled (else to the first content).",
                                 list(LABELS), buckets=E2E_BUCKETS, registry=reg)
        self.decode = Histogram(f"{NS}_request_decode_time_seconds", "Prompt prefilled to the "
                                "last content generated.", list(LABELS), buckets=E2E_BUCKETS,
                                registry=reg)
        self.itl = Histogram(f"{NS}_inter_token_latency_seconds", "Time between two pieces of "
                             "content of an answer (a token from the in-process engine; a "
                             "stream event from an upstream).", list(LABELS),
                             buckets=ITL_BUCKETS, registry=reg)
        self.success = Counter(f"{NS}_request_success_total", "API answers (below 400) by why "
                               "they ended: stop, length, tool_calls, abort (cut before an "
                               "end: the client left, or shutdown).",
                               [*LABELS, "finished_reason"], registry=reg)

    def arrived(self) -> None:
        """An API request is in (waiting until ``dispatched``)."""
        self.waiting.inc()

    def dispatched(self) -> None:
        """It was handed to its engine or upstream (running until ``observe``)."""
        self.waiting.dec()
        self.running.inc()

    def observe(self, record: RequestRecord) -> None:
        """One finished request, in every family."""
        labels = (record.api, record.model, record.cache, self.tenant_label(record.tenant)
                  if record.tenant else "")
        status = str(record.status or 500)
        if record.on_dispatch is not None:  # counted in the gauges since ``arrived``
            (self.running if record.dispatched is not None else self.waiting).dec()
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
        for metric, seconds in ((self.queue, record.queue_s), (self.prefill, record.prefill_s),
                                (self.decode, record.decode_s)):
            if seconds is not None:
                self._child(metric, *labels).observe(seconds)
        itl = self._child(self.itl, *labels)
        for gap in record.content_gaps:
            itl.observe(gap)
        reason = record.finish_reason if record.finish_reason in FINISHED_REASONS else "abort"
        self._child(self.success, *labels, reason).inc()

