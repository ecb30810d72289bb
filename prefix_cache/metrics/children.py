"""Labelled children of Prometheus metrics, remembered: ``metric.labels(*values)`` builds and
locks its way to the same child on every call, and a hit records several labelled samples."""

from __future__ import annotations

from typing import Any

MAX_CHILDREN = 10_000   # label values are bounded (results, models, tenants); so is this map


class LabelledChildren:
    """``children(metric, *values)`` is ``metric.labels(*values)``, remembered (at most
    ``max_children``; past that, looked up each time)."""

    def __init__(self, max_children: int = MAX_CHILDREN) -> None:
        self._max = max_children
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}

    def __call__(self, metric: Any, *values: str) -> Any:
        key = (id(metric), values)
        child = self._children.get(key)
        if child is None:
            child = metric.labels(*values)
            if len(self._children) < self._max:
                self._children[key] = child
        return child
