"""Prometheus metrics of upstream pools, per replica: requests by routing choice, requests in
flight, ejections and retries (``prefix_cache_upstream_*``).

Recorded at event time through the pool's observer, so prometheus-client's multiprocess mode
sums them across workers as it does the cache's metrics. Labels are bounded by configuration:
``model`` and ``replica`` (the replica's base URL) come from the operator's models file or
flags, ``choice`` from ``routing.CHOICES``.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge

from ..metrics import NS, Metrics
from ..metrics.multiprocess import multiprocess_dir
from .pool import PoolObserver, UpstreamPool
from .routing import CHOICES


class PoolMetrics:
    """The pool metric families, registered once per ``Metrics``."""

    def __init__(self, metrics: Metrics) -> None:
        reg = None if multiprocess_dir() is not None else metrics.registry
        self.requests = Counter(
            f"{NS}_upstream_requests_total", "Requests sent to an upstream replica, by why it "
            "was chosen: affinity (its key's first choice), spill (the first was over the load "
            "bound), failover (a retry), least_loaded, round_robin.",
            ["model", "replica", "choice"], registry=reg)
        self.in_flight = Gauge(f"{NS}_upstream_in_flight", "Requests in flight to a replica.",
                               ["model", "replica"], registry=reg, multiprocess_mode="livesum")
        self.ejections = Counter(f"{NS}_upstream_ejections_total", "Times a replica failed and "
                                 "was left out of routing for a backoff.", ["model", "replica"],
                                 registry=reg)
        self.retries = Counter(f"{NS}_upstream_retries_total", "Requests that failed on a "
                               "replica before answering and were sent to the next one.",
                               ["model", "replica"], registry=reg)

    def watch(self, model: str, pool: UpstreamPool) -> None:
        """Record ``pool``'s events under ``model``; every series starts at zero."""
        for name in pool.names:
            for choice in CHOICES:
                self.requests.labels(model, name, choice)
            self.in_flight.labels(model, name).set(0)
            self.ejections.labels(model, name)
            self.retries.labels(model, name)
        pool.observer = _ModelObserver(self, model)


class _ModelObserver(PoolObserver):
    def __init__(self, metrics: PoolMetrics, model: str) -> None:
        self._m = metrics
        self._model = model

    def routed(self, replica: str, choice: str) -> None:
        self._m.requests.labels(self._model, replica, choice).inc()
        self._m.in_flight.labels(self._model, replica).inc()

    def ended(self, replica: str) -> None:
        self._m.in_flight.labels(self._model, replica).dec()

    def ejected(self, replica: str) -> None:
        self._m.ejections.labels(self._model, replica).inc()

    def retried(self, replica: str) -> None:
        self._m.retries.labels(self._model, replica).inc()
