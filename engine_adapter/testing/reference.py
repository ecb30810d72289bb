"""Reference computations without any cache, for tests and the benchmark: what the engine's
next-token distribution must equal.

``dense_logprobs`` is one plain forward over the whole prompt. ``masked_logprobs`` is what a
sparse prefill of the ``visible`` tokens computes, done the dense way: every token at its true
position, every token seeing only visible tokens (and itself) before it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import mlx.core as mx


def _head(model: Any, h: mx.array) -> mx.array:
    if hasattr(model, "lm_head"):
        return model.lm_head(h)
    return model.model.embed_tokens.as_linear(h)


def _logprobs(logits: mx.array) -> mx.array:
    logits = logits.astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def dense_logprobs(model: Any, ids: Sequence[int]) -> mx.array:
    """Log-probabilities (vocab,) of the token after ``ids``, from one uncached forward."""
    h = model.model(mx.array(list(ids), dtype=mx.uint32)[None])
    return _logprobs(_head(model, h[:, -1:])[0, -1])


def masked_logprobs(model: Any, ids: Sequence[int], visible: Sequence[bool],
                    dense_layers: int = 0, dense_rows: int = 0) -> mx.array:
    """Log-probabilities after ``ids`` when each token attends only to visible tokens; except,
    in the first ``dense_layers`` layers, the first ``dense_rows`` tokens, which attend to all
    before them (a SpecPrefill that reuses a layer-truncated draft's layers: the draft computed
    the prompt's low layers densely; what is decoded after sees only the stored tokens)."""
    n = len(ids)
    if len(visible) != n:
        raise ValueError("visible must have one flag per token")
    seen = mx.array(list(visible))
    rows = mx.arange(n)[:, None]
    cols = mx.arange(n)[None]
    mask = (rows >= cols) & (seen[None] | (rows == cols))
    low = mask | ((rows >= cols) & (rows < dense_rows))
    h = model.model.embed_tokens(mx.array(list(ids), dtype=mx.uint32)[None])
    for i, layer in enumerate(model.model.layers):
        h = layer(h, low if i < dense_layers else mask, None)
    h = model.model.norm(h)
    return _logprobs(_head(model, h[:, -1:])[0, -1])


def kl_divergence(p_log: mx.array, q_log: mx.array) -> float:
    """KL(p || q) in nats, from log-probabilities."""
    return cast(float, (mx.exp(p_log) * (p_log - q_log)).sum().item())
