"""Prometheus metrics for the cache, and the JSON stats the dashboard reads, from one source.

Metrics are recorded at event time through a ``CacheObserver`` (so prometheus-client's
multiprocess mode aggregates them across uvicorn workers when ``PROMETHEUS_MULTIPROC_DIR`` is
set), and the JSON stats are computed from the same collected samples, so ``/metrics``, the stats
endpoint and the dashboard can never disagree. Base units, ``_total`` counters.

Tenant labels are bounded: the first ``max_tenants`` tenants seen keep their name (tenants are
server-side configuration, so the names are the operator's, not the client's), the rest are
folded into ``other``.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Iterable
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from ..cache.observer import CacheObserver
from ..http.request_record import RequestRecord
from ..store.base import StoreStats
from .children import LabelledChildren
from .history import History
from .multiprocess import forget_dead_processes, multiprocess_dir
from .requests import RequestMetrics

log = logging.getLogger("prefix_cache.metrics")

NS = "prefix_cache"
OTHER = "other"
LATENCY_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                   0.1, 0.25, 0.5, 1.0, 2.5)
TOKEN_BUCKETS = (0, 64, 256, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
RESULTS = ("hit", "miss", "none", "error")
KEYS_RELOAD_RESULTS = ("ok", "invalid", "would_open")
# The request metrics a tenant's usage (for billing) is read from, and its fields.
USAGE_FIELDS = {"http_requests_total": "requests", "prompt_tokens_total": "prompt_tokens",
                "prompt_tokens_cached_total": "cached_tokens",
                "generation_tokens_total": "generated_tokens"}


class TenantLabels:
    """Maps tenant names to a bounded set of label values."""

    def __init__(self, max_tenants: int = 20) -> None:
        if max_tenants < 1:
            raise ValueError(f"max_tenants must be >= 1, got {max_tenants}")
        self.max_tenants = max_tenants
        self._known: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, tenant: str) -> str:
        if tenant in self._known:
            return tenant
        with self._lock:
            if len(self._known) < self.max_tenants:
                self._known.add(tenant)
                return tenant
        return OTHER


class Metrics(CacheObserver):
    """The service's metrics; also the cache's observer."""

    def __init__(self, registry: CollectorRegistry | None = None, max_tenants: int = 20) -> None:
        # In multiprocess mode the metric objects write to files and must not be registered
        # (the scrape builds a fresh registry over the files); otherwise use our own registry so
        # several apps in one process (tests) do not collide.
        # No ``*_created`` series: prometheus-client's switch for the process (its only other
        # form is the environment), and Prometheus does not read them from the text format.
        disable_created_metrics()
        self._multiprocess = multiprocess_dir() is not None
        self.registry = registry if registry is not None else CollectorRegistry()
        self._collectors: list[Collector] = []
        reg = None if self._multiprocess else self.registry
        self.tenant_label = TenantLabels(max_tenants)
        self._child = LabelledChildren()
        self.requests = Counter(f"{NS}_requests_total", "Boundary requests by cache result.",
                                ["result", "model", "tenant"], registry=reg)
        self.renders = Counter(f"{NS}_renders_total", "Probe renders run (four per computation).",
                               ["model"], registry=reg)
        self.render_seconds = Histogram(f"{NS}_render_seconds", "Two-probe computation time.",
                                        ["model"], buckets=LATENCY_BUCKETS, registry=reg)
        self.lookup_seconds = Histogram(f"{NS}_lookup_seconds",
                                        "Boundary resolution time, end to end, by cache result.",
                                        ["result"], buckets=LATENCY_BUCKETS, registry=reg)
        self.saved_seconds = Counter(f"{NS}_render_seconds_saved_total",
                                     "Estimated render time hits did not spend.", ["model"],
                                     registry=reg)
        self.static_tokens = Histogram(f"{NS}_static_prefix_tokens",
                                       "specprefill_system_end of answered requests.", ["model"],
                                       buckets=TOKEN_BUCKETS, registry=reg)
        self.store_errors = Counter(f"{NS}_store_errors_total", "Store calls that failed.",
                                    ["op"], registry=reg)
        for op in ("get", "put"):  # exposed at zero, so dashboards and alerts see the series
            self.store_errors.labels(op)
        self.cap_renders = Counter(f"{NS}_cap_renders_total",
                                   "Renders that located a request's first non-static text.",
                                   registry=reg)
        self.verification_failures = Counter(f"{NS}_verification_failures_total",
                                             "Stored entries rejected on read.", registry=reg)
        self.tokenizations = Counter(
            f"{NS}_prompt_tokenizations_total", "Rendered prompts tokenized: path fast (from "
            "the entry's split) or full, and why full.", ["path", "reason"], registry=reg)
        self.tokenize_checks = Counter(f"{NS}_tokenize_checks_total", "Sampled fast "
                                       "tokenizations re-done in full.", registry=reg)
        self.tokenize_mismatches = Counter(
            f"{NS}_tokenize_mismatches_total", "Sampled checks whose fast tokenization differed "
            "(fast tokenization is then off for that tokenizer).", ["model"], registry=reg)
        self.fast_path_offs = Counter(
            f"{NS}_fast_tokenize_off_total", "Tokenizers or static texts without fast "
            "tokenization.", ["model"], registry=reg)
        self.tokenizations.labels("fast", "")  # exposed at zero for dashboards and alerts
        self.tokenize_checks.inc(0)
        self.store_entries = Gauge(f"{NS}_store_entries", "Entries in the in-process store.",
                                   ["store"], registry=reg, multiprocess_mode="livesum")
        self.store_bytes = Gauge(f"{NS}_store_bytes", "Bytes in the in-process store.",
                                 ["store"], registry=reg, multiprocess_mode="livesum")
        self.store_evictions = Counter(f"{NS}_store_evictions_total", "Entries the in-process "
                                       "store evicted to stay within its bytes.", ["store"],
                                       registry=reg)
        self.store_evictions.labels("memory")   # exposed at zero for dashboards and alerts
        self._evictions_seen = 0   # the store's own count at the last refresh
        # livemax: a worker that died with its breaker open must not hold the gauge at 1.
        self.breaker_open = Gauge(f"{NS}_circuit_breaker_open",
                                  "1 while the shared store's circuit breaker is open.",
                                  registry=reg, multiprocess_mode="livemax")
        self.keys_reloads = Counter(
            f"{NS}_keys_reloads_total", "Keys-file re-reads (SIGHUP) by result: ok, invalid "
            "(the file did not load, or held no key) or would_open (no tenant key where there "
            "were some); refused ones keep the keys in use.", ["result"], registry=reg)
        for result in KEYS_RELOAD_RESULTS:  # exposed at zero, so an alert sees the series
            self.keys_reloads.labels(result)
        self.api = RequestMetrics(reg, self.tenant_label)
        self.history = History()  # the dashboard's, per 10 s interval

    # -- API requests -----------------------------------------------------------------------

    def request_started(self, record: RequestRecord) -> None:
        """An API request is in: waiting, then running once it is dispatched."""
        self.api.arrived()
        record.on_dispatch = self.api.dispatched

    def request_done(self, record: RequestRecord) -> None:
        """A finished API request (``http.request_record``), in the request metrics and the
        history; a failure here is logged, never the request's."""
        try:
            self.api.observe(record)
            self.history.request(self.tenant_label(record.tenant) if record.tenant else "",
                                 record.model, record.cache, record.status or 500,
                                 record.ttft_s, record.prompt_tokens, record.cached_tokens,
                                 record.generation_tokens)
        except Exception:
            log.exception("recording a request's metrics failed")

    # -- observer ---------------------------------------------------------------------------

    def resolved(self, *, cache: str, namespace: str, model: str, seconds: float,
                 static_tokens: int, boundary: int) -> None:
        tenant = self.tenant_label(namespace)
        self._child(self.requests, cache, model, tenant).inc()
        self.history.lookup(tenant, model, cache)
        self._child(self.lookup_seconds, cache).observe(seconds)
        self._child(self.static_tokens, model).observe(boundary)

    def failed(self, *, namespace: str, model: str, error: Exception) -> None:
        self.requests.labels("error", model, self.tenant_label(namespace)).inc()

    def computed(self, *, model: str, seconds: float, static_tokens: int, renders: int = 2) -> None:
        self.renders.labels(model).inc(renders)
        self.render_seconds.labels(model).observe(seconds)

    def saved(self, *, model: str, seconds: float) -> None:
        self._child(self.saved_seconds, model).inc(seconds)

    def cap_rendered(self) -> None:
        self.cap_renders.inc()

    def store_error(self, *, op: str) -> None:
        self.store_errors.labels(op).inc()

    def verification_failure(self) -> None:
        self.verification_failures.inc()

    def tokenized(self, *, model: str, fast: bool, reason: str) -> None:
        self._child(self.tokenizations, "fast" if fast else "full", reason).inc()

    def tokenize_checked(self, *, model: str, mismatch: bool) -> None:
        self.tokenize_checks.inc()
        if mismatch:
            self.tokenize_mismatches.labels(model).inc()

    def fast_path_off(self, *, model: str, reason: str) -> None:
        self.fast_path_offs.labels(model).inc()

    # -- store gauges -----------------------------------------------------------------------

    def refresh_store(self, stats: StoreStats) -> None:
        """Copy a store's ``stats()`` into the gauges (memory tier figures, breaker state)."""
        if stats.memory is not None:
            self.store_entries.labels("memory").set(stats.memory.entries)
            self.store_bytes.labels("memory").set(stats.memory.bytes)
            # The store counts evictions since it was made; the counter takes what is new.
            new = stats.memory.evictions - self._evictions_seen
            if new > 0:
                self.store_evictions.labels("memory").inc(new)
            self._evictions_seen = stats.memory.evictions
        if stats.remote is not None:
            self.breaker_open.set(1 if stats.remote.breaker == "open" else 0)

    # -- exposition -------------------------------------------------------------------------

    def collect(self) -> list[Metric]:
        """Every sample, aggregated across workers in multiprocess mode."""
        return list(self._scrape_registry().collect())

    def add_collector(self, collector: Collector) -> None:
        """A collector read at scrape time (in-process engines' counters), in this process's
        exposition whether or not multiprocess mode is on."""
        self._collectors.append(collector)
        if not self._multiprocess:
            self.registry.register(collector)

    def _scrape_registry(self) -> CollectorRegistry:
        if not self._multiprocess:
            return self.registry
        from prometheus_client import multiprocess

        forget_dead_processes()  # a killed worker's gauges leave the sums
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        for collector in self._collectors:
            registry.register(collector)
        return registry

    def exposition(self) -> tuple[bytes, str]:
        """The text format for ``GET /metrics`` and its content type."""
        return generate_latest(self._scrape_registry()), CONTENT_TYPE_LATEST

    def snapshot(self) -> dict[str, Any]:
        """The JSON stats (dashboard, admin): counts, hit rate, percentiles, per tenant/model."""
        stats = summarize_metrics(self.collect())
        stats["tenant_labels_max"] = self.tenant_label.max_tenants  # past it: "other"
        return stats


def _quantile(buckets: list[tuple[float, float]], q: float) -> float | None:
    """Estimate a quantile from cumulative (upper bound, count) buckets, as histogram_quantile."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    prev_bound, prev_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return prev_bound
            span = count - prev_count
            frac = (rank - prev_count) / span if span else 1.0
            return prev_bound + (bound - prev_bound) * frac
        prev_bound, prev_count = bound, count
    return prev_bound


def _usage_row(tenant: str, row: dict[str, float]) -> dict[str, Any]:
    """A tenant's usage: its counts, and its prompt tokens split into reused (the engine's KV
    hits: ``cached``) and computed (prefilled)."""
    counts = {k: int(v) for k, v in row.items()}
    reused = counts["cached_tokens"]
    return {"tenant": tenant, **counts, "reused_tokens": reused,
            "computed_tokens": max(0, counts["prompt_tokens"] - reused)}


def summarize_metrics(families: Iterable[Metric]) -> dict[str, Any]:
    """Turn collected samples into the stats document."""
    by_result = {r: 0.0 for r in RESULTS}
    tenants: dict[str, dict[str, float]] = {}
    models: dict[str, dict[str, float]] = {}
    # Series that are simply summed over all their label sets (and over workers).
    sums = dict.fromkeys((
        "render_seconds_saved_total", "renders_total", "store_errors_total",
        "verification_failures_total", "store_entries", "store_bytes", "store_evictions_total",
        "render_seconds_sum", "render_seconds_count", "tokenize_checks_total",
        "tokenize_mismatches_total"), 0.0)
    tokenized = {"fast": 0.0, "full": 0.0}
    breaker = 0.0
    lookup: dict[str, dict[float, float]] = {}
    render_buckets: dict[float, float] = {}
    usage: dict[str, dict[str, float]] = {}  # per tenant, of the API requests answered
    for family in families:
        for s in family.samples:
            name, labels, value = s.name.removeprefix(f"{NS}_"), s.labels, s.value
            if name in USAGE_FIELDS:
                if labels["tenant"] and (name != "http_requests_total"
                                         or int(labels["status"]) < 400):
                    row = usage.setdefault(labels["tenant"], dict.fromkeys(
                        USAGE_FIELDS.values(), 0.0))
                    row[USAGE_FIELDS[name]] += value
            elif name in sums:
                sums[name] += value
            elif name == "requests_total":
                by_result[labels["result"]] = by_result.get(labels["result"], 0.0) + value
                for table, label in ((tenants, labels["tenant"]), (models, labels["model"])):
                    row = table.setdefault(label, {r: 0.0 for r in RESULTS})
                    row[labels["result"]] = row.get(labels["result"], 0.0) + value
            elif name == "prompt_tokenizations_total":
                tokenized[labels["path"]] = tokenized.get(labels["path"], 0.0) + value
            elif name == "circuit_breaker_open":
                breaker = max(breaker, value)
            elif name in ("lookup_seconds_bucket", "render_seconds_bucket"):
                b = (lookup.setdefault(labels["result"], {}) if name == "lookup_seconds_bucket"
                     else render_buckets)
                le = float(labels["le"])
                b[le] = b.get(le, 0.0) + value

    def pct(buckets: dict[float, float]) -> dict[str, float | None]:
        ordered = sorted(buckets.items())
        return {f"p{int(q * 100)}": _quantile(ordered, q) for q in (0.5, 0.95, 0.99)}

    lookups = by_result["hit"] + by_result["miss"]

    def rows(table: dict[str, dict[str, float]]) -> list[dict[str, Any]]:
        out = []
        for label, row in table.items():
            looked = row["hit"] + row["miss"]
            out.append({"name": label, **{k: int(v) for k, v in row.items()},
                        "requests": int(sum(row.values())),
                        "hit_rate": row["hit"] / looked if looked else 0.0})
        return sorted(out, key=lambda r: (-r["requests"], r["name"]))

    return {
        "requests": {k: int(v) for k, v in by_result.items()},
        "requests_total": int(sum(by_result.values())),
        "hits": int(by_result["hit"]),
        "misses": int(by_result["miss"]),
        "hit_rate": by_result["hit"] / lookups if lookups else 0.0,
        "renders": int(sums["renders_total"]),
        "render_seconds_saved": sums["render_seconds_saved_total"],
        "render_seconds_mean": (sums["render_seconds_sum"] / sums["render_seconds_count"]
                                if sums["render_seconds_count"] else None),
        "latency_seconds": {
            "hit": pct(lookup.get("hit", {})),
            "miss": pct(lookup.get("miss", {})),
            "render": pct(render_buckets),
        },
        "store": {"entries": int(sums["store_entries"]), "bytes": int(sums["store_bytes"]),
                  "evictions": int(sums["store_evictions_total"]),
                  "errors": int(sums["store_errors_total"]),
                  "verification_failures": int(sums["verification_failures_total"]),
                  "breaker_open": bool(breaker)},
        "tokenization": {"fast": int(tokenized["fast"]), "full": int(tokenized["full"]),
                         "checks": int(sums["tokenize_checks_total"]),
                         "mismatches": int(sums["tokenize_mismatches_total"])},
        "tenants": rows(tenants),
        "models": rows(models),
        "usage": [_usage_row(t, row) for t, row in sorted(usage.items())],
    }
