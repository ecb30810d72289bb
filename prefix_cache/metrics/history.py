"""The dashboard's history: what each 10-second interval held, kept for two hours, per worker,
merged across workers when read.

Each worker tallies, per interval and per (tenant, model): the cache's lookups (hits, misses),
the API requests answered (their prompt, reused and generated tokens, and their TTFT as
histogram bucket counts, so the workers' intervals merge into a true p50), and samples of the
in-process engines' KV tiers. The ring keeps ``KEEP`` intervals (bounded: tenants are a bounded
label, models are configured). With ``PROMETHEUS_MULTIPROC_DIR`` each worker also writes its
ring to ``history_<pid>.json`` there (at most every ``WRITE_EVERY_S``), and a read merges
every worker's file, so any worker answers with the whole service's history and a page reload
keeps it. ``history_series.py`` turns the merged intervals into series.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from .multiprocess import multiprocess_dir
from .requests import TTFT_BUCKETS

log = logging.getLogger("prefix_cache.metrics")

INTERVAL_S = 10
KEEP = 720                      # two hours of 10 s intervals
WRITE_EVERY_S = 2.0
FILE_PREFIX = "history_"
# A tally's fields, in order; then the TTFT bucket counts of hits, then of misses.
FIELDS = ("lookups", "hits", "misses", "requests", "errors", "prompt", "cached", "generated")
N_BUCKETS = len(TTFT_BUCKETS) + 1          # the last one: above every bound
TTFT_HIT = len(FIELDS)
TTFT_MISS = TTFT_HIT + N_BUCKETS
TALLY_LEN = TTFT_MISS + N_BUCKETS
ENGINE_FIELDS = ("ram_bytes", "disk_bytes", "kv_hits", "kv_evictions")

Tallies = dict[tuple[str, str], list[float]]       # (tenant, model) -> a tally
Intervals = dict[int, Tallies]                      # interval number -> its tallies
EngineSamples = dict[int, dict[str, list[float]]]   # interval -> model -> ENGINE_FIELDS


def _bucket(seconds: float) -> int:
    for i, bound in enumerate(TTFT_BUCKETS):
        if seconds <= bound:
            return i
    return N_BUCKETS - 1


class History:
    """One worker's ring of intervals (see the module docstring)."""

    def __init__(self, interval_s: int = INTERVAL_S, keep: int = KEEP,
                 clock: Callable[[], float] = time.time, folder: str | None = None,
                 worker: int | None = None) -> None:
        self.interval_s = interval_s
        self.worker = worker  # the file's number; None: this process's pid
        self.keep = keep
        self.clock = clock
        self.folder = folder if folder is not None else multiprocess_dir()
        self.started = clock()
        self._intervals: Intervals = {}
        self._engines: EngineSamples = {}
        self._lock = threading.Lock()   # lookups are noted from the render threads too
        self._dirty = False
        self._written = 0.0

    def _tally(self, tenant: str, model: str) -> list[float]:
        """The current interval's tally of (tenant, model) (call with the lock held)."""
        now = int(self.clock() // self.interval_s)
        tallies = self._intervals.get(now)
        if tallies is None:
            tallies = self._intervals[now] = {}
            for old in [i for i in self._intervals if i <= now - self.keep]:
                del self._intervals[old]
                self._engines.pop(old, None)
        tally = tallies.get((tenant, model))
        if tally is None:
            tally = tallies[(tenant, model)] = [0.0] * TALLY_LEN
        self._dirty = True
        return tally

    def lookup(self, tenant: str, model: str, cache: str) -> None:
        """A boundary resolved by the cache (any route)."""
        with self._lock:
            tally = self._tally(tenant, model)
            tally[0] += 1
            if cache == "hit":
                tally[1] += 1
            elif cache == "miss":
                tally[2] += 1

    def request(self, tenant: str, model: str, cache: str, status: int, ttft_s: float | None,
                prompt: int, cached: int, generated: int) -> None:
        """An API request answered."""
        with self._lock:
            tally = self._tally(tenant, model)
            tally[3] += 1
            if status >= 400:
                tally[4] += 1
                return
            tally[5] += prompt
            tally[6] += cached
            tally[7] += generated
            if ttft_s is not None and cache in ("hit", "miss"):
                tally[(TTFT_HIT if cache == "hit" else TTFT_MISS) + _bucket(ttft_s)] += 1

    def sample_engines(self, samples: dict[str, list[float]]) -> None:
        """The in-process engines' KV figures now (model -> ENGINE_FIELDS values)."""
        with self._lock:
            now = int(self.clock() // self.interval_s)
            self._engines[now] = samples
            self._dirty = True

    # -- across workers -----------------------------------------------------------------------

    def _file(self) -> Path | None:
        if self.folder is None:
            return None
        return Path(self.folder) / f"{FILE_PREFIX}{self.worker or os.getpid()}.json"

    def _document(self) -> dict[str, object]:
        with self._lock:
            return {"interval_s": self.interval_s, "started": self.started,
                    "intervals": {str(i): [[t, m, v] for (t, m), v in tallies.items()]
                                  for i, tallies in self._intervals.items()},
                    "engines": {str(i): s for i, s in self._engines.items()}}

    def write(self, force: bool = False) -> None:
        """This worker's ring to its file (multiprocess mode), when it changed."""
        path = self._file()
        now = time.monotonic()
        if path is None or not self._dirty or (not force and now - self._written < WRITE_EVERY_S):
            return
        self._dirty, self._written = False, now
        tmp = path.with_suffix(".tmp")
        try:
            tmp.write_text(json.dumps(self._document()))
            tmp.replace(path)  # readers see the old file or the new, never half of one
        except OSError as exc:
            log.warning("history: cannot write %s: %r", path, exc)

    def merged(self) -> tuple[Intervals, EngineSamples, float]:
        """Every worker's intervals summed (this one's from memory), the engines' samples
        summed per model, and when the earliest worker started."""
        self.write(force=True)
        docs: Iterable[dict[str, object]] = [self._document()]
        if self.folder is not None:
            docs = [*docs, *_read_others(Path(self.folder), self._file())]
        intervals: Intervals = {}
        engines: EngineSamples = {}
        started = self.started
        for doc in docs:
            started = min(started, float(doc.get("started", started)))  # type: ignore[arg-type]
            for key, rows in dict(doc.get("intervals", {})).items():  # type: ignore[call-overload]
                into = intervals.setdefault(int(key), {})
                for tenant, model, values in rows:
                    tally = into.setdefault((tenant, model), [0.0] * TALLY_LEN)
                    for i, v in enumerate(values[:TALLY_LEN]):
                        tally[i] += v
            for key, samples in dict(doc.get("engines", {})).items():  # type: ignore[call-overload]
                into_e = engines.setdefault(int(key), {})
                for model, values in samples.items():
                    row = into_e.setdefault(model, [0.0] * len(ENGINE_FIELDS))
                    for i, v in enumerate(values[:len(ENGINE_FIELDS)]):
                        row[i] += v
        return intervals, engines, started


def _read_others(folder: Path, own: Path | None) -> list[dict[str, object]]:
    """The other workers' history files (a dead worker's too: what it counted happened)."""
    docs = []
    try:
        paths = [p for p in folder.glob(f"{FILE_PREFIX}*.json") if p != own]
    except OSError:
        return []
    for path in paths:
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # replaced or removed meanwhile: the next read has it
        if isinstance(doc, dict):
            docs.append(doc)
    return docs
