"""Well-formed entry keys for tests that fill a store directly."""

from __future__ import annotations


def key(ns: str, i: int) -> str:
    """The ``i``-th entry key of namespace ``ns`` (model ``m``)."""
    return f"spc:{ns}:m:{i:032x}"
