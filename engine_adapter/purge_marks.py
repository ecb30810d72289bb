"""When each namespace was last purged, on one process-wide clock, so a store can refuse what
a request made before the purge tries to store after it.

A request is stamped when it is made (``GenerationRequest.issued``), before it reaches the
engine. Its KV is stored later, on the engine thread (a prompt once prefilled, a reply after its
last token is delivered) or the disk tier's writer, unordered against an admin purge on another
thread. Every store checks the stamp under the lock its purge holds: a stamp older than the
namespace's purge is refused, so once a purge has answered nothing the tenant sent before it is
stored again (a request made after it stores as usual).
"""

from __future__ import annotations

import itertools
import threading

_ticks = itertools.count(1)
_tick_lock = threading.Lock()


def stamp() -> int:
    """The clock now: every call a larger number than any before it, in any thread."""
    with _tick_lock:
        return next(_ticks)


class PurgeMarks:
    """The stamp of each namespace's last purge (``None``: of every namespace); not
    thread-safe: the owning store calls it under its own lock."""

    def __init__(self) -> None:
        self._at: dict[str | None, int] = {}

    def mark(self, namespace: str | None) -> None:
        """A purge of ``namespace`` (None: all) happens now."""
        self._at[namespace] = stamp()

    def since(self, namespace: str, issued: int | None) -> bool:
        """Whether ``namespace`` was purged after ``issued`` (None: never refused)."""
        if issued is None:
            return False
        return max(self._at.get(namespace, 0), self._at.get(None, 0)) > issued
