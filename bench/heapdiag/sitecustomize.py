"""Heap diagnostics for ``bench/soak.py --trace-heap DIR`` (imported at start by every Python
process whose PYTHONPATH begins with this folder; it does nothing unless asked).

With ``SOAK_HEAP_DIR`` set, each process traces Python allocations (tracemalloc, one
frame) and every ``SOAK_HEAP_EVERY_S`` seconds appends one JSON line to
``DIR/<pid>.jsonl``: seconds since start, RSS, the traced total, and the 40 source lines holding
the most memory. Comparing a process's lines over the run shows what grows; the RSS that the
traced total does not explain is the allocator's and native code's.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import tracemalloc

_DIR = os.environ.get("SOAK_HEAP_DIR")
TOP = 40


def _rss() -> int:
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _record(path: str, every: float) -> None:
    started = time.monotonic()
    while True:
        time.sleep(every)
        snapshot = tracemalloc.take_snapshot()
        stats = snapshot.statistics("lineno")
        line = {"t": round(time.monotonic() - started, 1), "rss": _rss(),
                "traced": tracemalloc.get_traced_memory()[0], "argv": sys.argv[:3],
                "top": [[f"{s.traceback[0].filename}:{s.traceback[0].lineno}", s.size, s.count]
                        for s in stats[:TOP]]}
        with open(path, "a", encoding="utf-8") as out:
            out.write(json.dumps(line) + "\n")


if _DIR:
    tracemalloc.start(1)
    os.makedirs(_DIR, exist_ok=True)
    threading.Thread(target=_record, daemon=True, name="heap-diag",
                     args=(os.path.join(_DIR, f"{os.getpid()}.jsonl"),
                           float(os.environ.get("SOAK_HEAP_EVERY_S", "60")))).start()
