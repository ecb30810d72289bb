"""``PREFIX_CACHE_FAST_PATH=on|off``: whether the accelerators run (default on)."""

from __future__ import annotations

import os

FAST_PATH_ENV = "PREFIX_CACHE_FAST_PATH"
_VALUES = {"on": True, "off": False}


def fast_path_setting(given: bool | None = None) -> bool:
    """``given`` when it is a bool; else the environment's ``PREFIX_CACHE_FAST_PATH`` (``on``
    when unset). ValueError naming the value for anything but ``on`` or ``off``."""
    if given is not None:
        if not isinstance(given, bool):
            raise ValueError(f"fast_path must be True, False or None, got {given!r}")
        return given
    value = os.environ.get(FAST_PATH_ENV, "on")
    if value not in _VALUES:
        raise ValueError(f"{FAST_PATH_ENV} must be 'on' or 'off', got {value!r}")
    return _VALUES[value]
