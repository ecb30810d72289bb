"""Everything Prometheus sees, in one package: the sidecar's metrics tallied from the cache's
events (``sidecar.py``), in-process engines' counters read at scrape time (``engine.py``), and
the multiprocess folder kept to live workers (``multiprocess.py``). The upstream pools'
routing metrics live beside the pools (``service/pool_metrics.py``)."""

from __future__ import annotations

from .sidecar import NS, Metrics

__all__ = ["NS", "Metrics"]
