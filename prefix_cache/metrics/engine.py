"""Prometheus metrics of in-process engines, read from their counters at scrape time.

The engine keeps its own counters (``snapshot_stats()``, an ``EngineStats``: requests, tokens
reused from its KV stores and tokens computed, SpecPrefills and fallbacks, the two KV stores'
hits, bytes and entries), so a scrape-time collector exports them as they are instead of
mirroring each event. In-process engines need a single worker, so reading this process's
engines is the whole truth, in prometheus-client's multiprocess mode too. No mlx import here:
an engine is anything with ``snapshot_stats() -> EngineStats``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
    SummaryMetricFamily,
)

from ..engine.protocol import EngineStats, KVStoreStats

NS = "prefix_cache_engine"

# (metric name without the namespace and _total, EngineStats field, help)
COUNTERS = (
    ("requests", "requests", "Requests the engine admitted."),
    ("completed", "completed", "Requests that finished (length or stop)."),
    ("cancelled", "cancelled", "Requests cancelled by their client."),
    ("failed", "failed", "Requests that ended in an engine error."),
    ("generated_tokens", "generated_tokens", "Tokens generated."),
    ("specprefill", "specprefill", "Requests prefilled sparsely (SpecPrefill)."),
    ("specprefill_fallbacks", "fallbacks", "SpecPrefills that failed and fell back to dense."),
    ("conversation_hits", "conversation_hits",
     "Requests that restored more than their static prefix from an earlier prompt."),
    ("reused_generated_tokens", "reused_generated_tokens",
     "Prompt tokens restored that an earlier request generated (its reply, sent back)."),
)



class EngineCollector:
    """A prometheus-client collector over ``engines()``: ``(model name, engine)`` pairs."""

    def __init__(self, engines: Callable[[], Iterable[tuple[str, Any]]]) -> None:
        self._engines = engines

    def describe(self) -> list[Metric]:
        return []  # families are known only at scrape time; keeps registration lazy

    def collect(self) -> Iterator[Metric]:
        stats = []
        for name, engine in self._engines():
            try:
                stats.append((name, engine.snapshot_stats()))
            except Exception:  # a scrape must never fail because one engine could not answer
                continue
        yield from engine_families(stats)


def engine_families(stats: Iterable[tuple[str, EngineStats]]) -> Iterator[Metric]:
    """The metric families for ``(model name, snapshot_stats())`` pairs."""
    stats = list(stats)
    counters = {key: CounterMetricFamily(f"{NS}_{key}", text, labels=["model"])
                for key, _, text in COUNTERS}
    tokens = CounterMetricFamily(
        f"{NS}_prompt_tokens", "Prompt tokens, by how they got into the KV cache: reused "
        "(restored from the static-prefix or conversation store) or computed (prefilled).",
        labels=["model", "kind"])
    active = GaugeMetricFamily(f"{NS}_active_requests", "Requests in the engine now.",
                               labels=["model"])
    kv_bytes = GaugeMetricFamily(f"{NS}_kv_bytes", "Bytes of KV held by the engine's store.",
                                 labels=["model", "store"])
    kv_entries = GaugeMetricFamily(f"{NS}_kv_entries", "Entries in the engine's KV store.",
                                   labels=["model", "store"])
    kv_lookups = CounterMetricFamily(f"{NS}_kv_lookups", "KV store lookups by result.",
                                     labels=["model", "store", "result"])
    kv_evictions = CounterMetricFamily(f"{NS}_kv_evictions",
                                       "KV store entries evicted to stay within bytes.",
                                       labels=["model", "store"])
    usage = GaugeMetricFamily("prefix_cache_kv_cache_usage_perc", "Fraction (0 to 1) of the "
                              "engine's KV capacity in RAM in use: bytes held by its "
                              "static-prefix and conversation stores over their caps.",
                              labels=["model"])
    # vLLM's names (``spec_decode_*``) after the prefix, as the other vLLM-named metrics.
    drafted = CounterMetricFamily("prefix_cache_spec_decode_num_draft_tokens", "Draft tokens "
                                  "verified by speculative decoding.", labels=["model"])
    accepted = CounterMetricFamily("prefix_cache_spec_decode_num_accepted_tokens", "Draft "
                                   "tokens accepted (emitted without a decode step of their "
                                   "own).", labels=["model"])
    kv_rejected = CounterMetricFamily(f"{NS}_kv_rejected", "KV snapshots not kept because "
                                      "they are larger than the whole store (raise its bytes).",
                                      labels=["model", "store"])
    for name, s in stats:
        for key, field, _ in COUNTERS:
            counters[key].add_metric([name], float(getattr(s, field)))
        tokens.add_metric([name, "reused"], float(s.reused_tokens))
        tokens.add_metric([name, "computed"], float(s.prefilled_tokens))
        active.add_metric([name], float(s.active))
        drafted.add_metric([name], float(s.spec_decode_draft_tokens))
        accepted.add_metric([name], float(s.spec_decode_accepted_tokens))
        kv_stores: tuple[tuple[str, KVStoreStats | None], ...] = (
            ("static", s.kv_store), ("conversation", s.conversation_store))
        on = [kv for _, kv in kv_stores if kv is not None and kv.max_bytes > 0]
        if on:
            usage.add_metric([name], sum(kv.bytes for kv in on) / sum(kv.max_bytes for kv in on))
        for store, kv in kv_stores:
            if kv is None:
                continue  # that store is off
            kv_bytes.add_metric([name, store], float(kv.bytes))
            kv_entries.add_metric([name, store], float(kv.entries))
            kv_lookups.add_metric([name, store, "hit"], float(kv.hits))
            kv_lookups.add_metric([name, store, "miss"], float(kv.misses))
            kv_evictions.add_metric([name, store], float(kv.evictions))
            kv_rejected.add_metric([name, store], float(kv.rejected))
    if not stats:
        return
    yield from counters.values()
    yield from (tokens, active, kv_bytes, kv_entries, kv_lookups, kv_evictions, kv_rejected,
                usage, drafted, accepted)
    yield from kv_disk_families(stats)


def kv_disk_families(stats: list[tuple[str, EngineStats]]) -> Iterator[Metric]:
    """The KV disk tier's families (engines whose tier is on)."""
    on = [(name, s.kv_disk) for name, s in stats if s.kv_disk is not None]
    if not on:
        return
    lookups = CounterMetricFamily(f"{NS}_kv_disk_lookups", "KV disk tier lookups by result "
                                  "(after a RAM miss).", labels=["model", "result"])
    size = GaugeMetricFamily(f"{NS}_kv_disk_bytes", "Bytes of KV files on disk.",
                             labels=["model"])
    entries = GaugeMetricFamily(f"{NS}_kv_disk_entries", "KV files on disk.", labels=["model"])
    evictions = CounterMetricFamily(f"{NS}_kv_disk_evictions", "KV files deleted to stay "
                                    "within kv_disk_bytes.", labels=["model"])
    writes = CounterMetricFamily(f"{NS}_kv_disk_writes", "KV snapshots for the disk by "
                                 "result: written, dropped (the write queue was full) or "
                                 "failed.", labels=["model", "result"])
    discarded = CounterMetricFamily(f"{NS}_kv_disk_discarded", "Bad KV files deleted "
                                    "(truncated, corrupt, edited, another model's, an old "
                                    "format, not a regular file).",
                                    labels=["model"])
    full = GaugeMetricFamily(f"{NS}_kv_disk_full", "1 while the KV disk is full: the last "
                             "write failed for space even after evicting.", labels=["model"])
    loads = SummaryMetricFamily(f"{NS}_kv_disk_load_seconds", "Time to read a KV file "
                                "(a disk hit).", labels=["model"])
    for name, d in on:
        lookups.add_metric([name, "hit"], float(d.hits))
        lookups.add_metric([name, "miss"], float(d.misses))
        size.add_metric([name], float(d.bytes))
        entries.add_metric([name], float(d.entries))
        evictions.add_metric([name], float(d.evictions))
        writes.add_metric([name, "written"], float(d.writes))
        writes.add_metric([name, "dropped"], float(d.write_drops))
        writes.add_metric([name, "failed"], float(d.write_errors))
        discarded.add_metric([name], float(d.discarded))
        full.add_metric([name], float(d.disk_full))
        loads.add_metric([name], count_value=float(d.loads), sum_value=d.load_seconds)
    yield from (lookups, size, entries, evictions, writes, discarded, full, loads)


class EngineLoadCollector:
    """vLLM's two load gauges for one engine served alone (``serve-engine``), from its health
    report: requests running in it, and requests posted to it not yet taken (its inbox). In
    the sidecar the same names count API requests (``requests.py``), so this is not there."""

    def __init__(self, name: str, engine: Any) -> None:
        self._name, self._engine = name, engine

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        try:
            report = self._engine.health()
        except Exception:  # a scrape must never fail because the engine could not answer
            return
        for key, field, text in (
                ("running", "active", "Requests the engine is running."),
                ("waiting", "queued", "Requests posted to the engine not yet taken.")):
            family = GaugeMetricFamily(f"prefix_cache_num_requests_{key}", text,
                                       labels=["model"])
            family.add_metric([self._name], float(report.get(field, 0)))
            yield family


def engine_exposition(name: str, engine: Any) -> tuple[bytes, str]:
    """One engine's counters in the Prometheus text format, and its content type (the
    ``GET /metrics`` of ``serve-engine``)."""
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

    registry = CollectorRegistry()
    registry.register(EngineCollector(lambda: [(name, engine)]))
    registry.register(EngineLoadCollector(name, engine))
    return generate_latest(registry), CONTENT_TYPE_LATEST
