"""One token budget per engine step, shared fairly: which prefill work a step does.

vLLM v1's scheduler (one ``max_num_batched_tokens`` per step, decode first, chunked prefill),
Sarathi-Serve's stall-free batching and SGLang's chunked prefill bound the work of a step so
that no prompt, however long, holds up anyone's next token; here the prefill share of that
bound is also split across namespaces, so one tenant's flood cannot hold up another's first
token. ``StepBudget.schedule`` decides; ``StepClock`` sizes a step's prefill from measured step
times while a stream is running; the engine carries the plan out (``engine.py``). No mlx here:
a job is anything with the ``PrefillJob`` shape.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterator
from typing import Protocol

from ..defaults import DEFAULT_MIN_CHUNK, DEFAULT_STEP_TOKENS


class PrefillJob(Protocol):
    """A prompt being prefilled in chunks: dense (any number of tokens per advance) or a
    SpecPrefill (one model chunk of ``chunk`` tokens per advance, its scoring included)."""

    @property
    def request_id(self) -> str: ...

    @property
    def namespace(self) -> str: ...

    @property
    def chunk(self) -> int | None: ...       # None: dense, takes what it is given

    @property
    def left(self) -> int: ...               # tokens still to compute (an estimate if sparse)


def finishes(job: PrefillJob, tokens: int) -> bool:
    """Whether ``tokens`` complete ``job`` (a sparse job's ``left`` is an estimate)."""
    return job.chunk is None and tokens >= job.left


class StepBudget:
    """Prefill jobs waiting or running, per namespace, and the work of each engine step."""

    def __init__(self, tokens: int = DEFAULT_STEP_TOKENS,
                 min_chunk: int = DEFAULT_MIN_CHUNK) -> None:
        if tokens < 1 or min_chunk < 1:
            raise ValueError(f"a step's token budget and its smallest chunk must be >= 1, got "
                             f"{tokens} and {min_chunk}")
        self.tokens = tokens
        self.min_chunk = min(min_chunk, tokens)
        # namespace -> its jobs, oldest first; namespaces least recently served first
        self._queues: OrderedDict[str, deque[PrefillJob]] = OrderedDict()
        self._credit: dict[str, int] = {}    # what a namespace was charged beyond its share

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def waiting(self, namespace: str) -> bool:
        """Whether ``namespace`` has prefill work waiting."""
        return namespace in self._queues

    def __iter__(self) -> Iterator[PrefillJob]:
        for queue in list(self._queues.values()):
            yield from list(queue)

    def add(self, job: PrefillJob) -> None:
        self._queues.setdefault(job.namespace, deque()).append(job)

    def discard(self, request_id: str) -> PrefillJob | None:
        """Take the job of ``request_id`` out (finished, cancelled, failed); it, or None."""
        for name, queue in self._queues.items():
            for job in queue:
                if job.request_id == request_id:
                    queue.remove(job)
                    if not queue:
                        del self._queues[name]
                        self._credit.pop(name, None)
                    return job
        return None

    def clear(self) -> None:
        self._queues.clear()
        self._credit.clear()

    def schedule(self, decoding: int, prefill: int | None = None) -> list[tuple[PrefillJob, int]]:
        """This step's prefill work: (job, tokens) pairs, in the order to run them.

        1. The budget is ``tokens`` per step. Decode first: each of the ``decoding``
           sequences in the batch takes one token of it (its next token, or its first).
        2. What is left is the prefill share, at most ``prefill`` tokens when the step is
           sized by time (``StepClock``). It is split equally across the namespaces with
           prefill work waiting, visited least recently served first; a namespace whose equal
           part would be under ``min_chunk`` waits for a later step (the visit order rotates,
           so every namespace gets its turn).
        3. Within a namespace its part goes to its jobs oldest first: a dense job takes as many
           tokens as it has left, up to the part; a SpecPrefill job, one model chunk (its
           scoring or its sparse prefill), charged at its chunk size even where that is more
           than the part: the namespace's overdraft is taken from its next steps' parts.
        4. What a namespace cannot use (it has less work) goes to the others in the same order.
        5. The namespaces served go to the back of the order.
        6. The jobs this step finishes run first (their first tokens need not wait for the
           rest of the step; the engine may end the step after them).
        A prompt whose chunk is cut keeps its place: it goes on in the next step, where it is
        still its namespace's oldest.
        """
        prefill = min(self.tokens - decoding, self.tokens if prefill is None else prefill)
        if prefill <= 0 or not self._queues:
            return []
        names = list(self._queues)
        served = max(1, min(len(names), prefill // self.min_chunk))
        part = prefill // served
        plan: dict[int, tuple[PrefillJob, int]] = {}   # id(job) -> (job, tokens)
        spent = 0
        for name in names[:served]:
            credit = min(part, part + self._credit.get(name, 0))   # an overdraft paid back
            used = self._fill(name, credit, plan)
            self._credit[name] = min(0, credit - used)
            spent += used
        for name in names:                         # step 4: what is left, to whoever has work
            if spent >= prefill:
                break
            spent += self._fill(name, prefill - spent, plan)
        for name in names[:served]:
            if name in self._queues:
                self._queues.move_to_end(name)
        work = list(plan.values())
        return ([(j, n) for j, n in work if finishes(j, n)]
                + [(j, n) for j, n in work if not finishes(j, n)])

    def unrun(self, jobs: list[PrefillJob]) -> None:
        """The jobs of a plan the engine did not run (it ended the step early): their
        namespaces, where none of their work ran, go back to the front of the order, so
        ending a step early never costs a namespace its turn."""
        skipped = {job.namespace for job in jobs}
        for name in reversed([n for n in self._queues if n in skipped]):
            self._queues.move_to_end(name, last=False)

    def _fill(self, name: str, tokens: int, plan: dict[int, tuple[PrefillJob, int]]) -> int:
        """Give up to ``tokens`` to ``name``'s jobs oldest first; the tokens charged."""
        used = 0
        for job in self._queues.get(name, ()):
            if used >= tokens:
                break
            _, given = plan.get(id(job), (job, 0))
            if job.chunk is not None:           # one chunk per step, whatever is left
                if given:
                    continue
                plan[id(job)] = (job, job.chunk)
                used += job.chunk
                continue
            more = min(tokens - used, job.left - given)
            if more > 0:
                plan[id(job)] = (job, given + more)
                used += more
        return used


class StepClock:
    """How many prefill tokens a step may take, from measured step times.

    The rule: while a stream is running (a sequence past its first token, more to come), a
    step's prefill takes about as long as its decode step (``ratio`` of it), so the stream's
    next token waits for at most about one decode step's worth of other prompts' prefill (an
    inter-token gap near 2x a decode step; Sarathi-Serve's stall-free bound, in seconds rather
    than tokens: a prefill token's cost grows with the prompt's depth, a decode step's with the
    batch). Never under ``floor`` tokens (a model call costs a fixed overhead), never over the
    token budget. With no stream running, or before both times are measured: the token budget.
    Times are moving averages (weight ``alpha`` for the newest).
    """

    def __init__(self, ratio: float = 1.0, floor: int = 16, alpha: float = 0.25) -> None:
        self.ratio, self.floor, self.alpha = ratio, floor, alpha
        self.decode_s: float | None = None        # one decode step of the batch
        self.token_s: float | None = None         # one prefill token, recent chunks

    def _average(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.alpha * (new - old)

    def decoded(self, seconds: float) -> None:
        self.decode_s = self._average(self.decode_s, seconds)

    def prefilled(self, tokens: int, seconds: float) -> None:
        if tokens > 0:
            self.token_s = self._average(self.token_s, seconds / tokens)

    def prefill_tokens(self, budget: int, streaming: bool) -> int:
        if not streaming or self.decode_s is None or not self.token_s:
            return budget
        return max(min(self.floor, budget), min(budget, int(self.ratio * self.decode_s
                                                           / self.token_s)))
