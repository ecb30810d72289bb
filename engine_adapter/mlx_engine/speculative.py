"""Speculative decoding inside the batch: drafts from each sequence's own tokens (n-gram prompt
lookup, no extra model), verified in the batch's one decode forward.

    each decode step, rows that have a draft:
        inputs  row i: [pending token, draft_1 .. draft_k_i, padding to K]   (one forward, B x K+1)
        verify: the row's own sampler at each position in turn; draft j is taken while the
                sampler's pick equals it; the first pick that differs is the row's next pending
                token (so a step emits the pending token plus the accepted drafts)
        KV:     the positions after the last accepted draft are trimmed: all rows by the
                smallest such count (``trim``), the rest rolled to the row's left padding
                (BatchKVCache's right padding, as mlx-lm's own padded prefill does)
    no row has a draft: the plain, pipelined ``GenerationBatch.next``

Exact by construction: every token emitted is the pick of the row's sampler, called once per
emitted token, in order, on the logits plain decoding would give it (a grammar's sampler
consumes its picks as before; a seeded sampler splits its key the same number of times), so
greedy, seeded, grammar, stop tokens, max_tokens and logprobs are those of plain decoding.
Rounding aside: a forward over K+1 tokens sums in another order than one over one token.

Back-off (``Drafter``): a sequence whose drafts are all rejected stops drafting for 1, 2, 4 ..
64 steps; an accepted draft starts it again and lengthens the next draft. A lookup that finds
nothing waits 1, 2, 4, 8 steps before the next.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.generate import GenerationBatch
from mlx_lm.models.cache import BatchKVCache

from prefix_cache.engine.protocol import EngineCounts

from ..defaults import (
    DEFAULT_SPEC_BACKOFF_MAX,
    DEFAULT_SPEC_MAX_DRAFT,
    DEFAULT_SPEC_MIN_NGRAM,
    DEFAULT_SPEC_NGRAM,
)
from .sampling import greedy


DRY_SKIP_MAX = 8    # steps without a lookup after lookups that found nothing


class Drafter:
    """Prompt lookup for one sequence: the tokens that followed the latest earlier occurrence
    of its last n tokens (n from ``ngram`` down to ``min_ngram``), with its back-off state.

    An index per n maps an n-gram to where its latest continuation starts, updated as tokens
    come (O(1) per token), so a lookup never scans the context."""

    def __init__(self, tokens: Iterable[int], *, ngram: int = DEFAULT_SPEC_NGRAM,
                 min_ngram: int = DEFAULT_SPEC_MIN_NGRAM, max_draft: int = DEFAULT_SPEC_MAX_DRAFT,
                 backoff_max: int = DEFAULT_SPEC_BACKOFF_MAX) -> None:
        self.sizes = tuple(range(ngram, min_ngram - 1, -1))
        self.max_draft = max_draft
        self.backoff_max = backoff_max
        self.tokens: list[int] = []
        self._index: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.sizes}
        self.draft_len = 2          # the next draft's length: grows while drafts are taken
        self._misses = 0            # drafts rejected in a row
        self._skip = 0              # steps left without drafting
        self._dry = 0               # lookups in a row that found nothing
        self.extend(tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        """Tokens appended to the sequence (each n-gram before one now has a continuation)."""
        for token in tokens:
            p = len(self.tokens)
            for n, index in self._index.items():
                if p >= n:
                    index[tuple(self.tokens[p - n:p])] = p
            self.tokens.append(int(token))

    def propose(self, pending: int, limit: int) -> list[int]:
        """A draft of at most ``limit`` tokens to follow the sequence and ``pending`` (its next
        token, not yet appended); [] while backing off or where nothing matches."""
        limit = min(limit, self.draft_len)
        if limit <= 0:
            return []
        tokens, size = self.tokens, len(self.tokens) + 1   # the sequence, then ``pending``
        for n in self.sizes:
            if size <= n:
                continue
            start = self._index[n].get((*tokens[size - n:], pending))
            if start is not None:   # a continuation inside ``tokens``; ``pending`` may end it
                self._dry = 0
                return (tokens[start:start + limit] + [pending])[:limit]
        # Nothing to draft: look again after 1, 2, 4, 8 steps (a lookup syncs the batch on its
        # pending tokens, which costs plain chat mlx-lm's overlap of one step with the next).
        self._skip = min(1 << self._dry, DRY_SKIP_MAX)
        self._dry += 1
        return []

    def ready(self) -> bool:
        """Whether it drafts this step; a step backing off is counted down here."""
        if self._skip > 0:
            self._skip -= 1
            return False
        return True

    def verified(self, drafted: int, accepted: int) -> None:
        """How a draft fared: rejected outright backs off (doubling), else the next draft is
        one longer than what was taken (at most ``max_draft``)."""
        if drafted == 0:
            return
        if accepted == 0:
            self._skip = min(1 << self._misses, self.backoff_max)
            self._misses += 1
            self.draft_len = 2
        else:
            self._misses = 0
            self.draft_len = min(self.max_draft, max(2, accepted + 1 if accepted < drafted
                                                     else 2 * drafted))


@dataclass
class Speculation:
    """The engine's speculation: a drafter per batch uid, the step's token cap, the engine's
    counts (``spec_decode_*``) and what the last step drafted (the step's budget counts it)."""

    max_step_tokens: int
    stats: EngineCounts
    drafters: dict[int, Drafter] = field(default_factory=dict)
    last_step: int = 0

    def track(self, uid: int, tokens: Sequence[int]) -> None:
        """A sequence going into the batch, with the prompt it continues."""
        self.drafters[uid] = Drafter(tokens)

    def forget(self, uids: Iterable[int]) -> None:
        for uid in uids:
            self.drafters.pop(uid, None)

    def attach(self, generator: Any) -> None:
        """Make ``generator``'s (mlx-lm BatchGenerator, empty) decode batch a speculative one:
        sequences that leave prefill are added to it (``extend``), so it stays this class."""
        generator._generation_batch = SpeculativeBatch.empty_for(generator, self)


def speculation_supported(model: Any) -> bool:
    """Only plain attention KV can be trimmed per row (sliding windows rotate, recurrent
    state cannot be rewound)."""
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    try:
        return all(type(c) is KVCache for c in make_prompt_cache(model))
    except Exception:
        return False


class SpeculativeBatch(GenerationBatch):
    """mlx-lm's decode batch with a speculative step when some row has a draft."""

    speculation: Speculation

    @classmethod
    def empty_for(cls, generator: Any, speculation: Speculation) -> SpeculativeBatch:
        batch = cls.empty(generator.model, generator.sampler)
        batch.speculation = speculation
        return batch

    def filter(self, keep: list[int]) -> None:
        kept = {self.uids[i] for i in keep}
        self.speculation.forget(u for u in self.uids if u not in kept)
        super().filter(keep)

    def next(self) -> list[Any]:
        ready = self._ready() if self.uids and not any(self.logits_processors) else set()
        if not ready:
            return self._plain_next()
        mx.eval(self._next_tokens)
        pending = [int(t) for t in self._next_tokens.tolist()]
        drafts = self._drafts(pending, ready)
        width = max(len(d) for d in drafts)
        if width == 0:
            return self._plain_next()
        return self._speculate(pending, drafts, width)

    def _ready(self) -> set[int]:
        """The rows that may draft this step (rows backing off count their step down here; a
        batch of them keeps mlx-lm's pipelined step: no sync on the pending tokens)."""
        if not isinstance(self.prompt_cache[0], BatchKVCache):
            return set()
        drafters = self.speculation.drafters
        return {i for i, uid in enumerate(self.uids)
                if (d := drafters.get(uid)) is not None and d.ready()}

    def _plain_next(self) -> list[Any]:
        self.speculation.last_step = 0
        responses = super().next()
        for r in responses:
            drafter = self.speculation.drafters.get(r.uid)
            if drafter is not None:
                drafter.extend((r.token,))
        return responses

    # -- the speculative step ----------------------------------------------------------------

    def _drafts(self, pending: list[int], ready: set[int]) -> list[list[int]]:
        """Each row's draft: at most what its max_tokens leaves after the pending token, and
        the batch's forward at most ``max_step_tokens`` (the step's budget) wide."""
        spec = self.speculation
        cap = max(0, spec.max_step_tokens // len(self.uids) - 1)
        drafts: list[list[int]] = []
        for i, uid in enumerate(self.uids):
            left = self.max_tokens[i] - self._num_tokens[i] - 1
            drafts.append(spec.drafters[uid].propose(pending[i], min(cap, left))
                          if i in ready else [])
        return drafts

    def _speculate(self, pending: list[int], drafts: list[list[int]], width: int) -> list[Any]:
        spec = self.speculation
        rows = [[p, *d] + [0] * (width - len(d)) for p, d in zip(pending, drafts, strict=True)]
        inputs = mx.array(rows, dtype=mx.uint32)
        logits = self.model(inputs, cache=self.prompt_cache)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        picks = self._verify(logprobs, drafts)
        accepted = [len(p) - 1 for p in picks]
        rejected = [width - a for a in accepted]
        self._trim(rejected)
        drafted = sum(len(d) for d in drafts)
        spec.stats.spec_decode_draft_tokens += drafted
        spec.stats.spec_decode_accepted_tokens += sum(accepted)
        spec.last_step = drafted
        previous = self._next_logprobs
        self._next_tokens = mx.array([p[-1] for p in picks], dtype=mx.uint32)
        self._next_logprobs = [logprobs[i, a] for i, a in enumerate(accepted)]
        emitted_lps = [[previous[i], *(logprobs[i, j] for j in range(a))]
                       for i, a in enumerate(accepted)]
        # Evaluated here: the rows are read on other threads, which have no engine stream.
        mx.eval(self._next_logprobs, emitted_lps)
        responses, keep = [], []
        for i, uid in enumerate(self.uids):
            emitted = [pending[i], *drafts[i][:accepted[i]]]
            lps = emitted_lps[i]
            drafter = spec.drafters.get(uid)
            if drafter is not None:
                drafter.verified(len(drafts[i]), accepted[i])
                drafter.extend(emitted)
            self.tokens[i].extend(emitted)
            finished = self._respond(i, emitted, lps, responses)
            if not finished:
                keep.append(i)
        if len(keep) < len(self.uids):
            self.filter(keep)
        return responses

    def _verify(self, logprobs: mx.array, drafts: list[list[int]]) -> list[list[int]]:
        """Each row's sampler picks, position by position, while its picks equal the draft:
        the picks (the accepted drafts, then the first pick that differs or follows them)."""
        samplers = [s if s is not None else self.fallback_sampler
                    for s in (self.samplers or [None] * len(self.uids))]
        picks: list[list[int] | None] = [None] * len(drafts)
        plain = [i for i, s in enumerate(samplers) if s is greedy]
        if plain:  # greedy rows: every position at once, one sync
            best = mx.argmax(logprobs[mx.array(plain)], axis=-1).tolist()
            for i, row in zip(plain, best, strict=True):
                picks[i] = accepted_prefix(row, drafts[i])
        for i, sampler in enumerate(samplers):
            if picks[i] is not None:
                continue
            chosen: list[int] = []
            for j in range(len(drafts[i]) + 1):
                token = int(sampler(logprobs[i:i + 1, j]).item())
                chosen.append(token)
                if j == len(drafts[i]) or token != drafts[i][j]:
                    break
            picks[i] = chosen
        return [p for p in picks if p is not None]

    def _trim(self, rejected: list[int]) -> None:
        """Drop each row's last ``rejected[i]`` positions from the batch KV."""
        least = min(rejected)
        extra = [r - least for r in rejected]
        for c in self.prompt_cache:
            if least:
                c.trim(least)
            if any(extra):
                c.prepare(right_padding=extra)
                c.finalize()
        mx.eval([c.state for c in self.prompt_cache])

    def _respond(self, i: int, emitted: list[int], lps: list[mx.array],
                 responses: list[Any]) -> bool:
        """Responses for row ``i``'s tokens of this step, as ``GenerationBatch.next`` makes
        them: stop tokens and max_tokens end the row at that token; whether it ended."""
        for n, (token, lp) in enumerate(zip(emitted, lps, strict=True)):
            self._num_tokens[i] += 1
            reason = "length" if self._num_tokens[i] >= self.max_tokens[i] else None
            if self._matchers[i].advance(token):
                reason = "stop"
            if reason is None:
                responses.append(self.Response(self.uids[i], token, lp, None, None, None))
                continue
            cache = self.extract_cache(i)
            surplus = len(emitted) - n - 1    # accepted after the end: not this reply's
            if surplus:
                for c in cache:
                    c.trim(surplus)
                del self.tokens[i][-surplus:]
            responses.append(self.Response(self.uids[i], token, lp, reason, cache,
                                           self.tokens[i]))
            return True
        return False


def accepted_prefix(picks: Sequence[int], draft: Sequence[int]) -> list[int]:
    """The target's picks at each position kept while they equal the draft, plus the first
    pick that differs (or the one after the whole draft)."""
    n = 0
    while n < len(draft) and picks[n] == draft[n]:
        n += 1
    return list(picks[:n + 1])
