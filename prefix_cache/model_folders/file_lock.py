"""One writer at a time across processes: an exclusive ``flock`` on a lock file, for the
folders made on first use (tokenizer folders, the demo chat model, its GGUF).

Correctness never depends on it (each writer renames its finished work into place); it saves
the duplicate work of a server and a test, or two workers, making the same folder at once.
Where ``flock`` is missing (Windows) the writers just race.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Hold the exclusive lock of ``path`` (created, with its folder, if missing)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not on the platforms this runs on
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
