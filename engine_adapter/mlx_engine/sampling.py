"""Per-request token samplers: greedy, or temperature + top-p with an optional seed.

A seeded sampler owns its PRNG key and splits it once per token, so a request's tokens depend
only on its seed and its logits, never on what else is in the batch.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
from mlx_lm.sample_utils import apply_top_p

from ..defaults import GREEDY

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
