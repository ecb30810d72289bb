"""RoPE hooks on a loaded mlx-lm model: rotate at arbitrary positions, capture queries.

Both work by swapping each attention layer's ``rope`` module for the length of a ``with`` block,
so the model's own projection, norms and RoPE variant are used as they are (llama, qwen2 and
qwen3 call ``rope(queries)`` then ``rope(keys)``; tests check this per family). The swap is on the
shared model, so it must run on the thread that owns the model (the engine's thread).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import mlx.core as mx


def attention_modules(model: Any) -> list[Any]:
    """The attention module of every layer, in order, recurrent layers left out (gated
    DeltaNet: ``linear_attn``, no positions to rotate); ValueError if another layer has none."""
    modules = []
    for i, layer in enumerate(model.layers):
        attn = getattr(layer, "self_attn", None)
        if attn is None and hasattr(layer, "linear_attn"):
            continue
        if attn is None or not hasattr(attn, "rope"):
            raise ValueError(f"layer {i} has no self_attn.rope: architecture not supported")
        modules.append(attn)
    return modules


@contextlib.contextmanager
def swapped_ropes(model: Any, wrap: Callable[[int, Any], Any]) -> Iterator[None]:
    """Replace layer i's rope with ``wrap(i, rope)`` inside the block; always put it back."""
    modules = attention_modules(model)
    originals = [m.rope for m in modules]
    try:
        for i, (module, rope) in enumerate(zip(modules, originals, strict=True)):
            module.rope = wrap(i, rope)
        yield
    finally:
        for module, rope in zip(modules, originals, strict=True):
            module.rope = rope


class PositionPlan:
    """The positions of the tokens in the forward call about to run (set before each call)."""

    def __init__(self) -> None:
        self.current: mx.array | None = None


class _MappedRoPE:
    """Rotates token j of the call at ``plan.current[j]`` instead of at ``offset + j``.

    Each token becomes its own batch row, so the model's RoPE runs with a per-row offset array:
    the same kernel, the same numbers, at any positions.
    """

    def __init__(self, rope: Any, plan: PositionPlan) -> None:
        self._rope = rope
        self._plan = plan

    def __call__(self, x: mx.array, offset: Any = 0) -> mx.array:
        positions = self._plan.current
        if positions is None or x.shape[0] != 1 or x.shape[2] != positions.shape[0]:
            raise ValueError("mapped RoPE needs one sequence and one position per token")
        rows = x.transpose(2, 1, 0, 3)          # (L, heads, 1, dim)
        return self._rope(rows, offset=positions).transpose(2, 1, 0, 3)


@contextlib.contextmanager
def mapped_positions(model: Any, plan: PositionPlan) -> Iterator[None]:
    """Inside the block, every forward call rotates its tokens at ``plan.current``."""
    with swapped_ropes(model, lambda _i, rope: _MappedRoPE(rope, plan)):
        yield


class _CapturingRoPE:
    """Passes through, keeping the first rotated tensor of each call pair: the queries."""

    def __init__(self, rope: Any, sink: list[mx.array]) -> None:
        self._rope = rope
        self._sink = sink
        self._calls = 0

    def __call__(self, x: mx.array, offset: Any = 0) -> mx.array:
        out = self._rope(x, offset=offset)
        if self._calls % 2 == 0:
            self._sink.append(out)
        self._calls += 1
        return out


@contextlib.contextmanager
def captured_queries(model: Any, sinks: list[list[mx.array]]) -> Iterator[None]:
    """Inside the block, layer i's post-RoPE queries of every forward call go to ``sinks[i]``."""
    with swapped_ropes(model, lambda i, rope: _CapturingRoPE(rope, sinks[i])):
        yield
