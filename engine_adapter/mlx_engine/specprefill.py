"""SpecPrefill (arXiv 2502.02789): a draft model scores prompt tokens, the target keeps the best.

    draft: prefill the prompt, then ``lookahead`` greedy decode steps; their post-RoPE queries
           against the prompt's keys give softmax attention per (layer, head, step)
    score: average-pool along the prompt (kernel ``pool_kernel``), max over layers and heads,
           mean over lookahead steps; only tokens after the boundary are scored
    keep:  chunks of ``chunk_size`` ranked by mean score, ``keep_pct`` of them, the chunks covering
           the last ``tail_tokens`` always among them (chat templates end with structure)
"""

from __future__ import annotations

import math
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Any, cast

import mlx.core as mx

from ..defaults import (
    DEFAULT_CHUNK_SIZE,
    DEFAULT_KEEP_PCT,
    DEFAULT_LOOKAHEAD,
    DEFAULT_POOL_KERNEL,
    DEFAULT_PREFILL_STEP,
    DEFAULT_SPECPREFILL_THRESHOLD,
    DEFAULT_TAIL_TOKENS,
)
from .kv.cache import cache_size
from .prefill import dense_prefill_steps, next_logits, run_steps
from .rope import attention_modules, captured_queries


@dataclass(frozen=True, slots=True)
class SpecPrefillConfig:
    """When SpecPrefill engages and how much it keeps."""

    keep_pct: float = DEFAULT_KEEP_PCT
    threshold: int = DEFAULT_SPECPREFILL_THRESHOLD  # tokens left to compute after the protected part
    chunk_size: int = DEFAULT_CHUNK_SIZE
    tail_tokens: int = DEFAULT_TAIL_TOKENS
    lookahead: int = DEFAULT_LOOKAHEAD
    pool_kernel: int = DEFAULT_POOL_KERNEL
    # The draft is the target's first layers (a layer-truncated copy): the target reuses the
    # draft's work for them (``draft_layers``); the engine checks the weights.
    reuse_draft_layers: bool = False
    # Models with sliding-window or recurrent layers get SpecPrefill too (opt-in: there it is
    # approximate beyond what it is on full attention; docs/engine.md, "Model families").
    hybrid: bool = False

    def __post_init__(self) -> None:
        if not 0.0 < self.keep_pct <= 1.0:
            raise ValueError(f"keep_pct must be in (0, 1], got {self.keep_pct}")
        for name in ("threshold", "tail_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("chunk_size", "lookahead", "pool_kernel"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    def asked(self, req: Any, rest: int, has_draft: bool) -> bool:
        """SpecPrefill is on for this request (a draft, not turned off, more than the threshold
        of ``rest`` tokens to compute), whatever the model's layers."""
        if not has_draft or req.specprefill is False:
            return False
        threshold = req.specprefill_threshold
        return rest > (self.threshold if threshold is None else threshold)

    def keep_share(self, req: Any) -> float:
        """The share of what is left to compute that this request keeps."""
        return float(req.specprefill_keep_pct or self.keep_pct)


def avg_pool(x: mx.array, kernel: int) -> mx.array:
    """Average over a centred window of ``kernel`` along the last axis, zero-padded, same length."""
    if kernel <= 1:
        return x
    left = kernel // 2
    right = kernel - 1 - left
    padded = mx.pad(x, [(0, 0)] * (x.ndim - 1) + [(left, right)])
    sums = mx.cumsum(padded, axis=-1)
    sums = mx.concatenate([mx.zeros(x.shape[:-1] + (1,), dtype=sums.dtype), sums], axis=-1)
    return (sums[..., kernel:] - sums[..., :-kernel]) / kernel


def attention_importance(queries: Sequence[Sequence[mx.array]], cache: Sequence[Any],
                         n_prompt: int, scales: Sequence[float], pool_kernel: int) -> mx.array:
    """Per-prompt-token importance (n_prompt,) from captured lookahead queries and cached keys."""
    best = None
    for layer_queries, layer_cache, scale in zip(queries, cache, scales, strict=True):
        q = mx.concatenate(list(layer_queries), axis=2)          # (1, H, steps, D)
        keys = layer_cache.keys[..., :n_prompt, :]                 # (1, Hkv, n, D)
        _, heads, steps, dim = q.shape
        kv_heads = keys.shape[1]
        # Query head h reads kv head h // (heads / kv_heads): group the queries, not the keys.
        q = q.reshape(1, kv_heads, (heads // kv_heads) * steps, dim)
        weights = mx.softmax((q @ keys.swapaxes(-1, -2)).astype(mx.float32) * scale, axis=-1)
        weights = avg_pool(weights.reshape(heads, steps, n_prompt), pool_kernel)
        layer_best = weights.max(axis=0)                            # (steps, n)
        best = layer_best if best is None else mx.maximum(best, layer_best)
    if best is None:
        raise ValueError("no attention layers to score with")
    return best.mean(axis=0)


def score_steps(draft: Any, ids: Sequence[int], start: int, cache: list[Any], *,
                lookahead: int = DEFAULT_LOOKAHEAD, pool_kernel: int = DEFAULT_POOL_KERNEL,
                step: int = DEFAULT_PREFILL_STEP,
                hidden: list[mx.array] | None = None) -> Generator[None, None, mx.array]:
    """Importance of ``ids[start:]`` by the draft (the generator's return value), one draft
    prefill chunk per step; ``cache`` may already hold a prefix of ids. The lookahead steps run
    in one go: the query capture on the draft must not span a yield. ``hidden``: gets the
    draft's last-layer output for the prompt positions it prefills (``cache``'s size on, up to
    the last prompt token), chunk by chunk."""
    n = len(ids)
    held = cache_size(cache)
    if not 0 <= held < n:
        raise ValueError(f"draft cache holds {held} tokens of a {n}-token prompt")
    yield from dense_prefill_steps(draft, ids[held:n - 1], cache, step, hidden)
    logits = next_logits(draft, ids[n - 1:], cache)
    modules = attention_modules(draft)
    sinks: list[list[mx.array]] = [[] for _ in modules]
    with captured_queries(draft, sinks):
        for _ in range(lookahead):
            token = cast(int, mx.argmax(logits).item())
            logits = next_logits(draft, [token], cache)
    scales = [float(getattr(m, "scale", sinks[0][0].shape[-1] ** -0.5)) for m in modules]
    importance = attention_importance(sinks, cache, n, scales, pool_kernel)[start:]
    mx.eval(importance)
    return importance


def score_tokens(draft: Any, ids: Sequence[int], start: int, cache: list[Any], *,
                 lookahead: int = DEFAULT_LOOKAHEAD, pool_kernel: int = DEFAULT_POOL_KERNEL,
                 step: int = DEFAULT_PREFILL_STEP) -> mx.array:
    """``score_steps`` at once: the importance of ``ids[start:]``."""
    return run_steps(score_steps(draft, ids, start, cache, lookahead=lookahead,
                                 pool_kernel=pool_kernel, step=step))


def select_chunks(importance: Sequence[float] | mx.array, keep_pct: float,
                  chunk_size: int = DEFAULT_CHUNK_SIZE,
                  tail_tokens: int = DEFAULT_TAIL_TOKENS) -> list[int]:
    """Sorted indices kept: whole chunks by mean importance, the tail chunks always."""
    scores = cast(list[float], importance.tolist() if isinstance(importance, mx.array)
                  else list(importance))
    m = len(scores)
    if keep_pct >= 1.0:
        return list(range(m))
    n_chunks = math.ceil(m / chunk_size)
    keep_n = max(1, math.ceil(n_chunks * keep_pct))
    n_tail = min(n_chunks, math.ceil(tail_tokens / chunk_size))
    ranked = range(n_chunks - n_tail)
    means = [_mean(scores[c * chunk_size:(c + 1) * chunk_size]) for c in ranked]
    best = sorted(ranked, key=lambda c: means[c], reverse=True)[:max(0, keep_n - n_tail)]
    chunks = sorted(best) + list(range(n_chunks - n_tail, n_chunks))
    return [i for c in chunks for i in range(c * chunk_size, min((c + 1) * chunk_size, m))]


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)
