"""Per-request token samplers: greedy, or temperature + top-p with an optional seed.

A seeded sampler owns its PRNG key and splits it once per token, so a request's tokens depend
only on its seed and its logits, never on what else is in the batch. A request under a grammar
gets its sampler wrapped (``GrammarSampler``): the mask is per sequence, so constrained and free
sequences share a batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import apply_top_p

from ..defaults import GREEDY
from .request import GenerationRequest

Sampler = Callable[[mx.array], mx.array]


def greedy(logprobs: mx.array) -> mx.array:
    """The most likely token of each row."""
    return mx.argmax(logprobs, axis=-1)


def make_sampler(temperature: float = GREEDY, top_p: float = 1.0, seed: int | None = None) -> Sampler:
    """A sampler over (rows, vocab) log-probabilities; temperature 0 is greedy."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if temperature == 0:
        return greedy
    inverse = 1.0 / temperature
    key = [mx.random.key(seed)] if seed is not None else None

    def sample(logprobs: mx.array) -> mx.array:
        if top_p < 1.0:
            logprobs = apply_top_p(logprobs, top_p)
        if key is None:
            return mx.random.categorical(logprobs * inverse)
        key[0], sub = mx.random.split(key[0])
        return mx.random.categorical(logprobs * inverse, key=sub)

    return sample


class GrammarSampler:
    """A sampler that picks only tokens a grammar allows: each call first advances the
    request's matcher by the token it chose last time, then masks the row's log-probabilities
    with the matcher's allowed tokens (one bit per token, from llguidance) before sampling.

    The batch samples one step ahead of its stop check (and of emitting), so every token a
    request gets has been checked here first. Once the grammar is complete (or broken) only
    the end-of-turn tokens are allowed: the turn ends there (a step after it is discarded). A
    token the matcher refuses (none can be, under the mask) is written to ``grammar.error``
    on this thread, where the backend reads it: such a request fails, it is never served.
    """

    def __init__(self, sampler: Sampler, grammar: Any) -> None:
        self.sampler, self.grammar = sampler, grammar
        self._last: mx.array | None = None

    def __call__(self, logprobs: mx.array) -> mx.array:
        matcher = self.grammar.matcher
        if self._last is not None and not matcher.is_stopped():
            # The token chosen last step, read now: this syncs the batch with its previous step.
            if not matcher.consume_token(int(self._last.item())) and self.grammar.error is None:
                self.grammar.error = matcher.get_error().splitlines()[0]
        if matcher.is_stopped() or matcher.is_error():
            allowed = np.zeros(logprobs.shape[-1], dtype=bool)
            allowed[list(self.grammar.eos_ids)] = True
        else:
            allowed = allowed_tokens(matcher.compute_bitmask(), logprobs.shape[-1])
        masked = mx.where(mx.array(allowed), logprobs, -mx.inf)
        masked = masked - mx.logsumexp(masked, axis=-1, keepdims=True)
        self._last = self.sampler(masked)
        return self._last


def allowed_tokens(bitmask: bytes, width: int) -> np.ndarray:
    """llguidance's bitmask (bit i of 32-bit little-endian words: token i allowed) as booleans
    over ``width`` logits; tokens past the tokenizer's vocabulary are never allowed."""
    bits = np.unpackbits(np.frombuffer(bitmask, dtype=np.uint8), bitorder="little")
    allowed = np.zeros(width, dtype=bool)
    n = min(width, bits.size)
    allowed[:n] = bits[:n]
    return allowed


def request_sampler(request: GenerationRequest) -> Sampler:
    """A request's sampler: its temperature, top-p and seed, under its grammar if it has one."""
    sampler = make_sampler(request.temperature, request.top_p, request.seed)
    return sampler if request.grammar is None else GrammarSampler(sampler, request.grammar)
