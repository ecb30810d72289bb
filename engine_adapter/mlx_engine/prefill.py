"""Filling a per-sequence cache: dense over a run of tokens, or sparse at original positions;
and which waiting prompt is prefilled next (``FairPrefill``).

Each is a step generator (one model chunk per step, so the engine can interleave other
sequences' decode steps, as ``BatchGenerator`` does with its own prefill); ``run_steps`` drives
one to its end at once.
"""

from __future__ import annotations

import math
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Generator, Sequence
from typing import Any, Generic, TypeVar, cast

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


K = TypeVar("K")


class FairPrefill(Generic[K]):
    """Prompts waiting for a prefill slot, per namespace, and which one goes next.

    ``BatchGenerator`` prefills up to ``slots`` prompts together, a chunk of each per step
    between decode steps (chunked prefill), first come first served: a tenant that sends many
    long prompts fills every slot and its queue, and another tenant's short prompt waits for
    all of them. Here prompts reach the generator only when a slot is free, and the next one is
    the oldest of the namespace holding the fewest slots (ties: the one served longest ago), so
    each namespace with work gets an equal share of the slots (vLLM's chunked prefill, SGLang's
    fair scheduling). One namespace alone never holds the last slot: a newcomer starts at the
    next step, without waiting for a long prefill to end.
    """

    def __init__(self, slots: int) -> None:
        if slots < 1:
            raise ValueError(f"prefill slots must be >= 1, got {slots}")
        self.slots = slots
        self._waiting: OrderedDict[str, deque[K]] = OrderedDict()  # least recently served first
        self._held: Counter[str] = Counter()                      # slots in use, by namespace
        self._holder: dict[K, str] = {}

    def __len__(self) -> int:
        return sum(len(q) for q in self._waiting.values())

    def push(self, namespace: str, item: K) -> None:
        self._waiting.setdefault(namespace, deque()).append(item)

    def free(self, item: K) -> None:
        """``item``'s slot, if it holds one, goes back (prefilled, cancelled, failed)."""
        namespace = self._holder.pop(item, None)
        if namespace is not None:
            self._held[namespace] -= 1
            if self._held[namespace] <= 0:
                del self._held[namespace]

    def discard(self, item: K) -> None:
        """Forget ``item``, waiting or holding a slot."""
        if item in self._holder:
            self.free(item)
            return
        for name, queue in self._waiting.items():
            if item in queue:
                queue.remove(item)
                if not queue:
                    del self._waiting[name]
                return

    def clear(self) -> None:
        self._waiting.clear()
        self._held.clear()
        self._holder.clear()

    def pop_ready(self) -> list[K]:
        """The waiting prompts that get a slot now, each now holding it until ``discard``."""
        ready: list[K] = []
        while self._waiting and sum(self._held.values()) < self.slots:
            active = len(set(self._waiting) | set(self._held))
            share = math.ceil(self.slots / active)
            cap = min(share, self.slots - 1) if self.slots > 1 and active == 1 else share
            names = [n for n in self._waiting if self._held[n] < cap]
            if not names:
                break
            name = min(names, key=lambda n: self._held[n])  # stable: least recently served
            queue = self._waiting.pop(name)
            item = queue.popleft()
            if queue:
                self._waiting[name] = queue  # to the back: served just now
            self._held[name] += 1
            self._holder[item] = name
            ready.append(item)
        return ready


class PrefillQueue:
    """Where a prompt waits before ``insert`` puts it into the batch: with ``fair``, for a
    ``FairPrefill`` slot (``release``, each loop; ``started`` once its first token is out);
    without, nowhere (first come first served, in the batch's own queue)."""

    def __init__(self, slots: int, fair: bool, insert: Callable[..., None]) -> None:
        self._fair: FairPrefill[str] | None = FairPrefill(slots) if fair else None
        self._insert = insert
        self._pending: dict[str, tuple[Any, ...]] = {}  # request id -> insert's arguments

    def __len__(self) -> int:
        """Prompts waiting for a slot."""
        return len(self._pending)

    def put(self, request_id: str, namespace: str, *args: Any) -> None:
        if self._fair is None:
            self._insert(*args)
            return
        self._pending[request_id] = args
        self._fair.push(namespace, request_id)

    def release(self, stream: Any) -> list[tuple[Any, Exception]]:
        """Insert the prompts that get a slot now (on ``stream``); the ones that failed to
        insert (their first argument: the sequence) with why."""
        failed = []
        for request_id in self._fair.pop_ready() if self._fair is not None else ():
            args = self._pending.pop(request_id)
            try:
                with mx.stream(stream):
                    self._insert(*args)
            except Exception as exc:
                failed.append((args[0], exc))
        return failed

    def started(self, request_id: str) -> None:
        """The request's prompt is prefilled (a token is out): its slot, if any, is free."""
        if self._fair is not None:
            self._fair.free(request_id)

    def forget(self, request_id: str) -> None:
        if self._fair is not None and self._pending.pop(request_id, None) is not None:
            self._fair.discard(request_id)
        self.started(request_id)
