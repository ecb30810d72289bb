"""The keys file, re-read while serving: on SIGHUP, in every worker.

A re-read builds the whole new configuration first (keys, admin and metrics keys, tenant
limits) and swaps it in one step on the event loop, so a request sees the old keys or the new
ones, never a mix; requests already admitted run on. A file that does not load (unreadable,
not YAML/JSON, a bad field, a limit naming no tenant) is refused with a log line and the old
keys stay. A key that is gone is refused from the next request on.

A re-read never opens what the keys in use keep locked: a file with no key at all (``tenants:``
with nothing under it, a file cut short or emptied by an editor) does not load, at start either
(``tenants.py``), and one with no tenant key where there were some (``/v1`` open to anyone) is
refused like it. Only a start without a keys file runs open. Each re-read is counted
(``prefix_cache_keys_reloads_total{result}``).

``prefix-cache serve --workers N`` runs a supervisor that passes a SIGHUP on to each worker
(``server.py``), instead of uvicorn's restart of every worker.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from collections.abc import Callable

from .state import ServiceState
from .tenants import KeyRing, KeysConfig

log = logging.getLogger("prefix_cache.service")

# A SIGHUP that came while the process was starting (before its loop could take it): SIGHUP's
# default would end the process; noted instead, and the keys re-read once serving starts.
_early_hup = threading.Event()


def note_early_sighup() -> None:
    """From process start until serving: a SIGHUP is noted, not fatal (main thread only)."""
    if threading.current_thread() is threading.main_thread() and hasattr(signal, "SIGHUP"):
        signal.signal(signal.SIGHUP, lambda signum, frame: _early_hup.set())


def reload_keys(state: ServiceState) -> bool:
    """Re-read the keys file into ``state``; False (and the old keys kept) if it is refused:
    it does not load, or it would open what the keys in use keep locked (``opens``)."""
    source = state.settings.keys_file
    counted = state.metrics.keys_reloads
    try:
        config = KeysConfig.load(state.settings)
        keyring = config.keyring()
    except (ValueError, OSError) as exc:
        log.error("keys file %s refused, the keys in use are kept: %s", source, exc)
        counted.labels("invalid").inc()
        return False
    opened = opens(state.keyring, keyring)
    if opened:
        log.error("keys file %s refused, the keys in use are kept: it would open %s to "
                  "anyone (a file cut short?); only a start with no keys runs open",
                  source, opened)
        counted.labels("would_open").inc()
        return False
    state.limits.update(config.tenant_limits)
    state.keyring = keyring
    log.info("keys file %s re-read: %s", source,
             "open, no tenant keys" if keyring.is_open else f"tenants {keyring.tenants}")
    counted.labels("ok").inc()
    return True


def opens(old: KeyRing, new: KeyRing) -> str | None:
    """What ``new`` would open that ``old`` keeps locked ("every endpoint", "/v1"), or None.
    The rule: a locked service stays locked; fewer keys are fine, no keys are not."""
    if new.is_unlocked and not old.is_unlocked:
        return "every endpoint"
    if new.is_open and not old.is_open:
        return "/v1"
    return None


def reload_keys_on_sighup(state: ServiceState) -> Callable[[], None]:
    """Re-read the keys on each SIGHUP to this process (the serving thread's loop); the
    function that undoes it. A no-op outside the main thread (a server in a test thread)."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    loop = asyncio.get_running_loop()
    try:
        loop.add_signal_handler(signal.SIGHUP, reload_keys, state)
    except (NotImplementedError, RuntimeError, AttributeError):  # no SIGHUP (Windows)
        return lambda: None
    if _early_hup.is_set():  # the file may have changed after this worker read it
        _early_hup.clear()
        reload_keys(state)
    return lambda: loop.remove_signal_handler(signal.SIGHUP)
