"""Filling a per-sequence cache: dense over a run of tokens, or sparse at original positions.

Each is a step generator (one model chunk per step, so the engine can interleave other
sequences' decode steps, as ``BatchGenerator`` does with its own prefill); ``run_steps`` drives
one to its end at once.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from typing import Any, TypeVar, cast

import mlx.core as mx

from ..defaults import DEFAULT_PREFILL_STEP
from .draft_layers import captured_hidden
from .rope import PositionPlan, mapped_positions

T = TypeVar("T")


def _evaluate(cache: Sequence[Any]) -> None:
    # Only the cache is evaluated: the logits of a prefill chunk stay lazy and are never computed.
    mx.eval([c.state for c in cache])


def dense_prefill_steps(model: Any, ids: Sequence[int], cache: list[Any],
                        step: int = DEFAULT_PREFILL_STEP,
                        hidden: list[mx.array] | None = None) -> Generator[None, None, None]:
    """Run ``ids`` through ``model`` after what ``cache`` holds, ``step`` tokens at a time,
    yielding after each chunk (the engine decodes other sequences in between). ``hidden``: gets
    each chunk's last-layer output (``draft_layers``)."""
    tokens = mx.array(list(ids), dtype=mx.uint32)
    for start in range(0, len(ids), step):
        if hidden is None:
            model(tokens[None, start:start + step], cache=cache)
            _evaluate(cache)
        else:
            with captured_hidden(model, hidden):
                model(tokens[None, start:start + step], cache=cache)
            mx.eval([c.state for c in cache], hidden[-1])
        yield


def sparse_prefill_steps(model: Any, ids: Sequence[int], positions: Sequence[int],
                         cache: list[Any],
                         step: int = DEFAULT_PREFILL_STEP) -> Generator[None, None, None]:
    """Prefill only ``ids[p] for p in positions`` (increasing), each rotated at its own p,
    yielding after each chunk.

    The cache stores them contiguously; causal masking over storage order is right because the
    positions increase. RoPE is relative, so later tokens see the kept ones at their true
    distance. The model's RoPE is swapped only while a chunk's graph is built, never across a
    yield: the engine runs other sequences' decode steps on the same model in between.
    """
    if any(b <= a for a, b in zip(positions, positions[1:], strict=False)):
        raise ValueError("positions must be strictly increasing")
    tokens = mx.array([ids[p] for p in positions], dtype=mx.uint32)
    where = mx.array(list(positions), dtype=mx.int32)
    plan = PositionPlan()
    for start in range(0, len(positions), step):
        plan.current = where[start:start + step]
        with mapped_positions(model, plan):
            model(tokens[None, start:start + step], cache=cache)
        _evaluate(cache)
        yield


def run_steps(steps: Generator[None, None, T]) -> T:
    """Drive a step generator to its end, at once; its return value."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return cast(T, done.value)


def next_logits(model: Any, ids: Sequence[int], cache: list[Any]) -> mx.array:
    """Logits (vocab,) after feeding ``ids`` (usually one token) on top of ``cache``."""
    out = model(mx.array(list(ids), dtype=mx.uint32)[None], cache=cache)
    return out[0, -1]
