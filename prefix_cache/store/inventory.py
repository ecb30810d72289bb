"""What a store holds, by tenant and model: read off the keys, which carry both in the clear."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ..cache.keys import key_pattern, parse_key


def summarize(entries: Iterable[tuple[str, int]]) -> dict[str, Any]:
    """Counts and value bytes per namespace and per model from ``(key, bytes)`` pairs."""
    total = {"entries": 0, "bytes": 0}
    namespaces: dict[str, dict[str, Any]] = {}
    for key, size in entries:
        parts = parse_key(key)
        if parts is None:
            continue  # not one of ours
        ns = namespaces.setdefault(parts.namespace, {"entries": 0, "bytes": 0, "models": {}})
        m = ns["models"].setdefault(parts.model, {"entries": 0, "bytes": 0})
        for bucket in (total, ns, m):
            bucket["entries"] += 1
            bucket["bytes"] += size
    return {**total, "namespaces": dict(sorted(namespaces.items()))}


def inventory(store: Any, prefix: str, namespace: str | None = None, model: str | None = None) -> dict[str, Any]:
    """The summary of every entry under ``prefix`` (optionally one namespace and/or model)."""
    return summarize(store.scan(key_pattern(prefix, namespace, model)))
