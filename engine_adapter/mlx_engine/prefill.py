"""Filling a per-sequence cache: dense over a run of tokens, or sparse at original positions."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from .rope import PositionPlan, mapped_positions

DEFAULT_STEP = 2048


def _evaluate(cache: Sequence[Any]) -> None:
    # Only the cache is evaluated: the logits of a prefill chunk stay lazy and are never computed.
    mx.eval([c.state for c in cache])


def dense_prefill(model: Any, ids: Sequence[int], cache: list[Any], step: int = DEFAULT_STEP) -> None:
    """Run ``ids`` through ``model`` after what ``cache`` holds, ``step`` tokens at a time."""
    tokens = mx.array(list(ids), dtype=mx.uint32)
    for start in range(0, len(ids), step):
        model(tokens[None, start:start + step], cache=cache)
        _evaluate(cache)


def sparse_prefill(model: Any, ids: Sequence[int], positions: Sequence[int], cache: list[Any],
                   step: int = DEFAULT_STEP) -> None:
    """Prefill only ``ids[p] for p in positions`` (increasing), each rotated at its own p.

    The cache stores them contiguously; causal masking over storage order is right because the
    positions increase. RoPE is relative, so later tokens see the kept ones at their true
    distance.
    """
    if any(b <= a for a, b in zip(positions, positions[1:], strict=False)):
        raise ValueError("positions must be strictly increasing")
    tokens = mx.array([ids[p] for p in positions], dtype=mx.uint32)
    where = mx.array(list(positions), dtype=mx.int32)
    plan = PositionPlan()
    with mapped_positions(model, plan):
        for start in range(0, len(positions), step):
            plan.current = where[start:start + step]
            model(tokens[None, start:start + step], cache=cache)
            _evaluate(cache)


def next_logits(model: Any, ids: Sequence[int], cache: list[Any]) -> mx.array:
    """Logits (vocab,) after feeding ``ids`` (usually one token) on top of ``cache``."""
    out = model(mx.array(list(ids), dtype=mx.uint32)[None], cache=cache)
    return out[0, -1]
