"""Memo keys that carry types: values that compare equal but render differently (``2``, ``2.0``
and ``True``; ``(1,)`` and ``[1]``) never share an entry."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

_SCALARS = (str, int, float, bool, type(None), bytes)


class Unkeyable(Exception):
    """A value no memo key can stand for (the call is then made without the memo)."""


def typed_key(value: Any) -> Hashable:
    """``value`` with every part tagged by its exact type; Unkeyable for what is neither a
    scalar of a built-in type nor a list or tuple of such values."""
    kind = type(value)
    if kind in _SCALARS:
        return kind, value
    if kind in (list, tuple):
        return kind, tuple(typed_key(item) for item in value)
    raise Unkeyable(kind.__qualname__)
