"""A layer-truncated draft's work reused by the target (issue #26, part 4).

When the draft is the target's first N layers, weights and all (``convert --layers N``,
``demo_chat_model_dir(layers=N)``), its dense prefill of the prompt computes exactly what the
target's first N layers would compute densely: their keys and values for every token, and the
hidden state every token leaves layer N with. So after scoring, the target's sparse prefill
need not run those layers at all:

    layers < N    the draft's keys and values at the kept positions, taken as they are (each
                  kept token's low layers attended to the whole document, not only to the kept
                  ones: denser than a sparse prefill of them)
    layers >= N   run from the draft's layer-N hidden states of the kept tokens, at their own
                  positions, attending to the protected part and the kept tokens only

Every layer stores the same positions (the protected part, then the kept tokens), so the cache
is an ordinary sparse one to the rest of the engine. Its values differ from a plain sparse
prefill's in the low layers, so its snapshots are tagged apart (``engine._keep_share``).
Supported where the engine's sparse prefill is (plain full-attention KV, ``layer(h, mask,
cache)`` blocks); ``shared_layers`` checks the weights themselves, not the folder's name.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator, Iterator, Sequence
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.base import create_attention_mask

from .rope import PositionPlan, mapped_positions


def shared_layers(target: Any, draft: Any) -> int:
    """N when ``draft`` is ``target``'s embedding and first N layers exactly (same classes,
    parameter names, shapes, dtypes and values) and has fewer layers than it; else 0."""
    try:
        t_layers, d_layers = list(target.layers), list(draft.layers)
        pairs = [(target.model.embed_tokens, draft.model.embed_tokens)]
    except AttributeError:
        return 0
    n = len(d_layers)
    if type(target) is not type(draft) or not 0 < n < len(t_layers):
        return 0
    if any(getattr(layer, "use_sliding", False) for layer in t_layers):
        return 0
    for ours, theirs in [*pairs, *zip(t_layers[:n], d_layers, strict=True)]:
        if type(ours) is not type(theirs) or not _same_parameters(ours, theirs):
            return 0
    return n


def reused_layers(reuse: bool, target: Any, draft: Any | None) -> int:
    """The draft layers the target reuses: ``shared_layers`` when asked (``reuse``) and there is
    a draft; ValueError when asked and the draft is not the target's first layers."""
    if not reuse or draft is None:
        return 0
    n = shared_layers(target, draft)
    if not n:
        raise ValueError("reuse_draft_layers: the draft is not the target's first layers "
                         "(a layer-truncated copy of it, same weights), or the model's layers "
                         "are not plain full-attention ones")
    return n


def _same_parameters(a: Any, b: Any) -> bool:
    left, right = tree_flatten(a.parameters()), tree_flatten(b.parameters())
    if [k for k, _ in left] != [k for k, _ in right]:
        return False
    return all(x.shape == y.shape and x.dtype == y.dtype and bool(mx.array_equal(x, y))
               for (_, x), (_, y) in zip(left, right, strict=True))


class _Recording:
    """A layer that also appends its output to a list; every attribute is the layer's (the
    model's forward reads some, such as ``use_sliding``)."""

    def __init__(self, layer: Any, sink: list[mx.array]) -> None:
        self._layer = layer
        self._sink = sink

    def __call__(self, *args: Any, **kwargs: Any) -> mx.array:
        out = self._layer(*args, **kwargs)
        self._sink.append(out)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._layer, name)


@contextlib.contextmanager
def captured_hidden(model: Any, sink: list[mx.array]) -> Iterator[None]:
    """Inside the block, what ``model``'s last layer outputs (the hidden state before the final
    norm) is appended to ``sink``, call by call. Swapped on the shared model for one chunk's
    graph only, like the RoPE hooks."""
    layers = model.layers
    last = layers[-1]
    layers[-1] = _Recording(last, sink)
    try:
        yield
    finally:
        layers[-1] = last


def layered_sparse_prefill_steps(target: Any, shared: int, draft_cache: Sequence[Any],
                                 hidden: mx.array, hidden_start: int, positions: Sequence[int],
                                 cache: list[Any], step: int) -> Generator[None, None, None]:
    """The target's sparse prefill of ``positions`` (increasing) from the draft's work: layers
    below ``shared`` get the draft's keys and values at those positions, the rest run from
    ``hidden`` (the draft's last-layer output for prompt positions ``hidden_start`` on),
    ``step`` tokens a chunk, yielding after each."""
    if any(b <= a for a, b in zip(positions, positions[1:], strict=False)):
        raise ValueError("positions must be strictly increasing")
    if positions and (positions[0] < hidden_start
                      or positions[-1] >= hidden_start + hidden.shape[1]):
        raise ValueError("kept positions outside what the draft computed")
    where = mx.array(list(positions), dtype=mx.int32)
    for ours, theirs in zip(cache[:shared], draft_cache[:shared], strict=True):
        keys = mx.take(theirs.keys[..., : theirs.offset, :], where, axis=2)
        values = mx.take(theirs.values[..., : theirs.offset, :], where, axis=2)
        ours.update_and_fetch(keys, values)
    states = mx.take(hidden, where - hidden_start, axis=1)
    mx.eval([c.state for c in cache[:shared]], states)
    upper = list(target.layers)[shared:]
    plan = PositionPlan()
    for start in range(0, len(positions), step):
        h = states[:, start:start + step]
        plan.current = where[start:start + step]
        with mapped_positions(target, plan):
            mask = create_attention_mask(h, cache[shared])
            for layer, layer_cache in zip(upper, cache[shared:], strict=True):
                h = layer(h, mask, cache=layer_cache)
        mx.eval([c.state for c in cache[shared:]])
        yield
