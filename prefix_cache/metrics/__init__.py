"""Everything Prometheus sees, in one package: the sidecar's metrics tallied from the cache's
events (``sidecar.py``), in-process engines' counters read at scrape time (``engine.py``), the
multiprocess folder kept to live workers (``multiprocess.py``), what each API request cost
(``requests.py``), labelled children remembered for both (``children.py``), and the dashboard's
10 s history (``history.py``, served as ``history_series.py``). The upstream pools' routing
metrics live beside the pools (``service/pool_metrics.py``).
"""

from __future__ import annotations

from .sidecar import NS, Metrics

__all__ = ["NS", "Metrics"]
