"""prometheus-client's multiprocess folder (``PROMETHEUS_MULTIPROC_DIR``): kept to the processes
that are alive.

Every worker writes its samples to files named after its pid, and a scrape sums or maxes what
the folder holds. Left alone, the folder keeps what dead processes wrote: a previous run's
gauges (a circuit breaker that was open then reads as open forever) and a killed worker's store
entries, still in the sums. So ``serve`` empties the folder before any worker starts, a worker
that exits cleanly marks itself dead, and each scrape first forgets the live-mode gauges of
processes that are gone (a worker killed with SIGKILL runs no exit code of its own). Counters
and histograms of dead workers stay: what they counted did happen.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

ENV = "PROMETHEUS_MULTIPROC_DIR"
# The files prometheus-client writes: <kind>[_<mode>]_<pid>.db
# and the dashboard's history (``history.py``): history_<pid>.json
_FILE = re.compile(r"^((counter|gauge|histogram|summary)(_[a-z]+)?_(\d+)\.db|history_\d+\.json)$")
_LIVE_GAUGE = re.compile(r"^gauge_live[a-z]+_(\d+)\.db$")


def multiprocess_dir() -> str | None:
    return os.environ.get(ENV) or None


def clear_multiprocess_dir() -> int:
    """Before a server's workers start: remove the metric files an earlier run left (only
    prometheus-client's own files), making the folder if needed; the count removed."""
    folder = multiprocess_dir()
    if folder is None:
        return 0
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    removed = 0
    for file in path.iterdir():
        if _FILE.match(file.name) and file.is_file():
            file.unlink(missing_ok=True)
            removed += 1
    return removed


def mark_process_dead(pid: int | None = None) -> None:
    """Drop a process's live gauges from the aggregate (this process's by default)."""
    folder = multiprocess_dir()
    if folder is not None:
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(os.getpid() if pid is None else pid, folder)


def forget_dead_processes() -> list[int]:
    """Mark dead every process whose live gauges are in the folder but which is gone; their
    pids. Cheap (a directory listing), so every scrape runs it."""
    folder = multiprocess_dir()
    if folder is None:
        return []
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    pids = {int(m.group(1)) for m in map(_LIVE_GAUGE.match, names) if m}
    dead = sorted(pid for pid in pids if not process_alive(pid))
    for pid in dead:
        mark_process_dead(pid)
    return dead


def process_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped by its parent, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: alive, and not ours to judge
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no /proc (macOS): the signal check is all there is
    return stat.rpartition(")")[2].split()[0] != "Z"
