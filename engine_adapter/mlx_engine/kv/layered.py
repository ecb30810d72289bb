"""Snapshots of models whose caches are not all plain KV: sliding-window layers
(``RotatingKVCache``: Gemma 3, gpt-oss) and recurrent layers (``ArraysCache``: the gated
DeltaNet layers of Qwen3-Next and Qwen3.5), beside full-attention ``KVCache`` layers.

A recurrent state cannot be trimmed and a window cannot be widened back, so such a snapshot
stands for exactly the ``n_tokens`` the sequence had processed when it was taken: the engine
takes it at a segment end (``BatchGenerator`` stops there) and restores it only whole. Each
layer keeps what its type needs to go on: a full layer its ``n_tokens`` keys and values, a
sliding layer the last ``max_size`` of them (in order) and its offset, a recurrent layer its
state arrays. Restored caches are the model's own types, with positions at ``n_tokens``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

LAYER_TYPES = (KVCache, RotatingKVCache, ArraysCache)


@dataclass(frozen=True, slots=True)
class KVLayer:
    """A full-attention layer: the keys and values of every token."""

    keys: mx.array
    values: mx.array


@dataclass(frozen=True, slots=True)
class WindowLayer:
    """A sliding-window layer: its last ``len(keys)`` tokens in order, at ``offset``."""

    keys: mx.array
    values: mx.array
    offset: int
    max_size: int
    keep: int


@dataclass(frozen=True, slots=True)
class StateLayer:
    """A recurrent layer: its state arrays (conv window, DeltaNet state)."""

    arrays: tuple[mx.array | None, ...]


Layer = KVLayer | WindowLayer | StateLayer


@dataclass(frozen=True, slots=True)
class LayeredSnapshot:
    """Per-layer state of a sequence after exactly ``n_tokens`` prompt tokens; always dense.

    Shares the read side of ``cache.KVSnapshot`` that the engine's reuse uses, but restores
    only whole (``trimmable`` False): a lookup that shares fewer tokens cannot use it."""

    layers: tuple[Layer, ...]
    n_tokens: int
    nbytes: int
    positions: None = None
    span: None = None
    keep_pct: None = None   # always dense: no keep share chose what it holds
    reply_from: int | None = None   # stored ids from here on were generated (``reply``)
    trimmable = False

    @property
    def prompt_tokens(self) -> int:
        return self.n_tokens

    @property
    def dense_tokens(self) -> int:
        return self.n_tokens

    def stored_before(self, n: int) -> int:
        return min(n, self.n_tokens)

    def positions_before(self, n: int) -> None:
        return None


def _plain_kv(c: Any) -> bool:
    # KVCache, or a subclass that differs from it only in how a batch merges it (``plain_kv``:
    # the engine's PositionedKVCache); a chunked cache is a subclass that is not.
    return type(c) is KVCache or bool(getattr(type(c), "plain_kv", False))


def supports_layered_cache(caches: Sequence[Any]) -> bool:
    """Whether every layer's cache is of a type a ``LayeredSnapshot`` keeps (exact types: a
    quantized or chunked cache is none of them), with at least one attention layer: the engine
    counts a sequence's tokens off those (a recurrent state does not count them)."""
    return (all(type(c) in LAYER_TYPES or _plain_kv(c) for c in caches)
            and any(type(c) is not ArraysCache for c in caches))


def window_at(c: RotatingKVCache, n_tokens: int) -> RotatingKVCache:
    """A sliding-window layer after a sparse prefill, as a dense one stands after ``n_tokens``:
    its stored tokens in order (their last ``max_size``), its offset at ``n_tokens``. Right
    when the last window of prompt tokens was kept (SpecPrefill on hybrids forces it): they
    are then exactly the tokens a dense window holds, each rotated at its own position."""
    layer = _window(c, c.offset)
    return _restored(WindowLayer(layer.keys, layer.values, n_tokens, layer.max_size,
                                 layer.keep), n_tokens, copy=False)


def max_window(caches: Sequence[Any]) -> int:
    """The widest sliding window among the layers (0: none)."""
    return max((c.max_size for c in caches if type(c) is RotatingKVCache), default=0)


def _window(c: RotatingKVCache, n_tokens: int) -> WindowLayer:
    if c.offset != n_tokens:
        raise ValueError(f"a sliding-window layer holds {c.offset} tokens, not {n_tokens}")
    # In temporal order, the last max_size tokens: all that any later token can attend to.
    size = min(c.offset, c.max_size)
    keys, values = (mx.contiguous(c._temporal_order(a)[..., -size:, :])
                    for a in (c.keys, c.values))
    return WindowLayer(keys, values, c.offset, c.max_size, c.keep)


def _layer(c: Any, n_tokens: int) -> Layer:
    if type(c) is ArraysCache:
        return StateLayer(tuple(None if a is None else mx.array(a) for a in c.cache))
    if type(c) is RotatingKVCache:
        return _window(c, n_tokens)
    if c.keys is None or c.offset < n_tokens:
        raise ValueError(f"cache holds fewer than {n_tokens} tokens")
    return KVLayer(mx.contiguous(c.keys[..., :n_tokens, :]),
                   mx.contiguous(c.values[..., :n_tokens, :]))


def _arrays(layer: Layer) -> list[mx.array]:
    if isinstance(layer, StateLayer):
        return [a for a in layer.arrays if a is not None]
    return [layer.keys, layer.values]


def snapshot_layers(cache: Sequence[Any], n_tokens: int) -> LayeredSnapshot:
    """Copy of a per-sequence cache that has processed exactly ``n_tokens`` tokens, evaluated."""
    if not supports_layered_cache(cache):
        raise ValueError("a layered snapshot needs KVCache, RotatingKVCache or ArraysCache layers")
    layers = tuple(_layer(c, n_tokens) for c in cache)
    arrays = [a for layer in layers for a in _arrays(layer)]
    mx.eval(arrays)
    return LayeredSnapshot(layers, n_tokens, sum(a.nbytes for a in arrays))


def _restored(layer: Layer, n_tokens: int, copy: bool) -> Any:
    def own(a: mx.array) -> mx.array:
        return mx.array(a) if copy else a

    if isinstance(layer, StateLayer):
        c = ArraysCache(len(layer.arrays))
        c.cache = [None if a is None else own(a) for a in layer.arrays]
        return c
    if isinstance(layer, WindowLayer):
        w = RotatingKVCache(layer.max_size, layer.keep)
        w.keys, w.values = own(layer.keys), own(layer.values)
        w.offset, w._idx = layer.offset, layer.keys.shape[2]
        return w
    kv = KVCache()
    kv.keys, kv.values, kv.offset = own(layer.keys), own(layer.values), n_tokens
    return kv


def restore_layers(snap: LayeredSnapshot, n_tokens: int | None = None, *,
                   copy: bool = True) -> list[Any]:
    """The model's own per-layer caches at ``snap.n_tokens`` (``n_tokens``, if given, must be
    that: the state cannot be trimmed). ``copy`` as in ``cache.restore``."""
    if n_tokens is not None and n_tokens != snap.n_tokens:
        raise ValueError(f"cannot restore {n_tokens} tokens from a snapshot of exactly "
                         f"{snap.n_tokens}")
    return [_restored(layer, snap.n_tokens, copy) for layer in snap.layers]


# -- as named arrays and a description per layer (a KV file on the disk tier, file.py) --------

def layers_to_arrays(snap: LayeredSnapshot) -> tuple[dict[str, mx.array], list[dict[str, Any]]]:
    """The snapshot's arrays by name (``k.<i>``/``v.<i>``: full and window layers,
    ``s.<i>.<j>``: a recurrent layer's state) and each layer's kind and fields."""
    arrays: dict[str, mx.array] = {}
    kinds: list[dict[str, Any]] = []
    for i, layer in enumerate(snap.layers):
        if isinstance(layer, StateLayer):
            present = [a is not None for a in layer.arrays]
            for j, a in enumerate(layer.arrays):
                if a is not None:
                    arrays[f"s.{i}.{j}"] = mx.contiguous(a)
            kinds.append({"kind": "state", "present": present})
            continue
        arrays[f"k.{i}"], arrays[f"v.{i}"] = layer.keys, layer.values
        kinds.append({"kind": "kv"} if isinstance(layer, KVLayer) else
                     {"kind": "window", "offset": layer.offset, "max_size": layer.max_size,
                      "keep": layer.keep})
    return arrays, kinds


def _decoded(i: int, kind: dict[str, Any], arrays: dict[str, mx.array], n_tokens: int) -> Layer:
    if kind.get("kind") == "state":
        present = kind.get("present")
        if not isinstance(present, list):
            raise ValueError(f"layer {i}: no state arrays listed")
        return StateLayer(tuple(arrays[f"s.{i}.{j}"] if p is True else None
                                for j, p in enumerate(present)))
    keys, values = arrays[f"k.{i}"], arrays[f"v.{i}"]
    if kind.get("kind") == "kv":
        if keys.shape[-2] != n_tokens or values.shape[-2] != n_tokens:
            raise ValueError(f"layer {i}: not {n_tokens} tokens of keys and values")
        return KVLayer(keys, values)
    offset, max_size, keep = kind.get("offset"), kind.get("max_size"), kind.get("keep")
    if (kind.get("kind") != "window" or offset != n_tokens or not isinstance(max_size, int)
            or max_size < 1 or not isinstance(keep, int) or not 0 <= keep < max_size
            or keys.shape[-2] != min(n_tokens, max_size) or values.shape[-2] != keys.shape[-2]):
        raise ValueError(f"layer {i}: not a window of the snapshot's tokens")
    return WindowLayer(keys, values, offset, max_size, keep)


def layers_from_arrays(arrays: dict[str, mx.array], kinds: list[dict[str, Any]],
                       n_tokens: int) -> LayeredSnapshot:
    """The inverse of ``layers_to_arrays``; ValueError (or KeyError) if the arrays and the
    descriptions do not make a whole snapshot of ``n_tokens`` tokens, every array used."""
    if not kinds or not all(isinstance(k, dict) for k in kinds):
        raise ValueError("no layers described")
    layers = tuple(_decoded(i, kind, arrays, n_tokens) for i, kind in enumerate(kinds))
    used = [a for layer in layers for a in _arrays(layer)]
    if len(used) != len(arrays) or not any(not isinstance(x, StateLayer) for x in layers):
        raise ValueError("arrays the layers do not account for, or no attention layer")
    return LayeredSnapshot(layers, n_tokens, sum(a.nbytes for a in used))
