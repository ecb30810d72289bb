"""Filling a per-sequence cache: dense over a run of tokens, or sparse at original positions;
and a dense prompt the engine prefills itself under the step's budget (``ChunkedPrefill``).

Each is a step generator (one model chunk per step, so the engine can interleave other
sequences' decode steps, as ``BatchGenerator`` does with its own prefill); ``run_steps`` drives
one to its end at once. Which prompt gets how many tokens in a step: ``budget``.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from typing import Any, TypeVar, cast

import mlx.core as mx

from ..defaults import DEFAULT_PREFILL_STEP
from .draft_layers import captured_hidden
from .model_info import BatchGenerator, StopSequences
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


def new_batch_generator(model: Any, stop_token_ids: Sequence[int], max_batch: int,
                        prefill_batch: int, step: int) -> BatchGenerator:
    """mlx-lm's continuous batch: ``prefill_batch`` prompts prefilled together, ``step`` tokens
    of each between decode steps."""
    return BatchGenerator(model, stop_tokens=[[t] for t in stop_token_ids] or None,
                          completion_batch_size=max_batch, prefill_batch_size=prefill_batch,
                          prefill_step_size=step)


def insert_sequence(generator: BatchGenerator, seq: Any, segments: list[list[int]],
                    cache: list[Any]) -> int:
    """Put an engine sequence's prompt (``segments``, after ``cache``) into the batch; its uid."""
    req = seq.request
    stops = None
    if req.stop_token_ids is not None:
        stops = [StopSequences([[t] for t in req.stop_token_ids])]
    (uid,) = generator.insert_segments([segments], max_tokens=[req.max_tokens], caches=[cache],
                                       samplers=[seq.sampler], stop_sequences=stops)
    return int(uid)


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


class ChunkedPrefill:
    """A dense prompt prefilled by the engine itself, as many tokens per step as the step's
    budget gives it (``budget``): every prompt token but the last into ``cache``, never past a
    segment's end in one model call (the static prefix is snapshotted exactly there). Once
    done, the sequence goes into the batch with its last token, which generation starts from.
    Chunking never changes the result: causal attention over a cache fed in pieces is the
    attention over the whole."""

    chunk = None    # dense: takes whatever number of tokens the budget gives

    def __init__(self, seq: Any, model: Any, segments: list[list[int]], cache: list[Any],
                 start: int) -> None:
        self.seq = seq
        self.model = model
        self.cache = cache
        tokens = [t for segment in segments for t in segment]
        self.last = tokens[-1]
        self.tokens = mx.array(tokens[:-1], dtype=mx.uint32)
        self.start = start                   # prompt tokens in ``cache`` before these
        ends, at = [], 0
        for segment in segments:
            at += len(segment)
            ends.append(min(at, len(tokens) - 1))
        self.ends = sorted({e for e in ends if e > 0})   # where a segment ends, in ``tokens``
        self.done = 0
        # A restored sparse history stores fewer tokens than it stands for; its rows are
        # rotated ahead only once merged into the batch, so here the rest is rotated at its
        # own prompt positions.
        self._positions = PositionPlan() if any(
            getattr(c, "position_shift", 0) for c in cache) else None

    @property
    def request_id(self) -> str:
        return str(self.seq.request.request_id)

    @property
    def namespace(self) -> str:
        return str(self.seq.request.namespace)

    @property
    def left(self) -> int:
        return int(self.tokens.shape[0]) - self.done

    def advance(self, n: int) -> int | None:
        """Compute up to ``n`` more tokens, stopping at a segment's end; the prompt position
        reached when that was a segment's end (the engine stores or parks there), else None."""
        end = next(e for e in self.ends if e > self.done)
        stop = min(self.done + n, end)
        if stop > self.done:
            chunk = self.tokens[None, self.done:stop]
            if self._positions is None:
                self.model(chunk, cache=self.cache)
            else:
                self._positions.current = mx.arange(self.start + self.done, self.start + stop,
                                                    dtype=mx.int32)
                with mapped_positions(self.model, self._positions):
                    self.model(chunk, cache=self.cache)
            _evaluate(self.cache)
            self.done = stop
        return self.start + stop if stop == end else None
