"""mlx's per-thread streams, destroyed by the thread that made them before it ends.

mlx leaves a thread's streams to be cleaned up when asked (``mx.clear_streams()``, "at the end
of a thread, the main thread included", as its maintainers recommend): left to the runtime's
own teardown they are destroyed after the interpreter is gone, and a process that has run a
generation can then abort at exit ("terminate called without an active exception", SIGABRT).
Every thread the engine runs mlx on (its loop, the KV disk writer) ends through
``releasing_streams``; the main thread (which loads the weights) at interpreter exit.
"""

from __future__ import annotations

import atexit
import functools
from collections.abc import Callable
from typing import Any

import mlx.core as mx


def release_streams() -> None:
    """Destroy the calling thread's mlx streams (a no-op on an mlx without the call)."""
    clear = getattr(mx, "clear_streams", None)
    if clear is not None:
        clear()


def releasing_streams(target: Callable[..., Any]) -> Callable[..., Any]:
    """``target`` as a thread's body that destroys the thread's streams when it ends."""

    @functools.wraps(target)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return target(*args, **kwargs)
        finally:
            release_streams()

    return run


atexit.register(release_streams)  # runs on the main thread, before the interpreter goes
