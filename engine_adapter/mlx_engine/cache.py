"""Per-sequence KV caches for the engine: RoPE positions that can run ahead of what is stored,
snapshots of a static prefix, and restores that never share arrays with the store.

After a sparse prefill a sequence stores K of its M prompt tokens, yet its next token must be
rotated at position M. mlx-lm's ``BatchKVCache`` already keeps storage (``_idx``, left padding)
apart from each row's RoPE position (``offset``), and carries ``offset`` through every
extend/filter, so the shift is applied once, when ``BatchGenerator`` merges the per-sequence
caches of newly inserted prompts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache


class PositionedKVCache(KVCache):
    """A ``KVCache`` whose row, once merged into a batch, is rotated ``position_shift`` ahead.

    Used on its own, it behaves exactly as ``KVCache`` (the shift only takes effect in
    ``merge``); the engine sets the shift after a sparse prefill, just before insertion.
    """

    def __init__(self, position_shift: int = 0) -> None:
        super().__init__()
        self.position_shift = position_shift

    @classmethod
    def merge(cls, caches: Sequence[KVCache]) -> BatchKVCache:
        batch = BatchKVCache.merge(caches)
        shifts = [getattr(c, "position_shift", 0) for c in caches]
        if any(shifts):
            batch.offset = batch.offset + mx.array(shifts)
        return batch


@dataclass(frozen=True, slots=True)
class KVSnapshot:
    """Keys and values of the first ``n_tokens`` of a sequence, one pair per layer."""

    layers: tuple[tuple[mx.array, mx.array], ...]
    n_tokens: int
    nbytes: int


def supports_positioned_cache(model: Any) -> bool:
    """Plain full-attention models only: a model whose own caches are anything but ``KVCache``
    (sliding windows, recurrent layers) keeps them, and the engine neither reuses nor
    sparsifies their KV."""
    if not hasattr(model, "layers"):
        return False
    make = getattr(model, "make_cache", None)
    return make is None or all(type(c) is KVCache for c in make())


def make_cache(model: Any) -> list[Any]:
    """A fresh per-sequence cache for ``model``."""
    if hasattr(model, "make_cache") and not supports_positioned_cache(model):
        return model.make_cache()
    return [PositionedKVCache() for _ in model.layers]


def cache_size(cache: Sequence[Any]) -> int:
    """Tokens stored in a per-sequence cache."""
    return int(cache[0].offset) if cache else 0


def snapshot(cache: Sequence[KVCache], n_tokens: int) -> KVSnapshot:
    """Copy of the first ``n_tokens`` of a per-sequence cache, evaluated."""
    if any(c.keys is None or c.offset < n_tokens for c in cache):
        raise ValueError(f"cache holds fewer than {n_tokens} tokens")
    layers = tuple(
        (mx.contiguous(c.keys[..., :n_tokens, :]), mx.contiguous(c.values[..., :n_tokens, :]))
        for c in cache if c.keys is not None and c.values is not None
    )
    mx.eval(layers)
    nbytes = sum(k.nbytes + v.nbytes for k, v in layers)
    return KVSnapshot(layers, n_tokens, nbytes)


def restore(snap: KVSnapshot, n_tokens: int | None = None, *,
            copy: bool = True) -> list[PositionedKVCache]:
    """A new per-sequence cache holding the snapshot's first ``n_tokens`` (all by default).

    With ``copy`` (the default) its arrays are copies, so later writes into the cache (slice
    assignment after a trim, say) never reach the store: what a cache that is prefilled in
    place needs. ``copy=False`` gives read-only views, for a cache handed straight to
    ``BatchGenerator.insert``: merging it into the batch copies it anyway, and a second copy
    before that would only cost time to first token."""
    n = snap.n_tokens if n_tokens is None else n_tokens
    if not 0 < n <= snap.n_tokens:
        raise ValueError(f"cannot restore {n} tokens from a snapshot of {snap.n_tokens}")
    caches = []
    for keys, values in snap.layers:
        c = PositionedKVCache()
        if n < snap.n_tokens:
            keys, values = keys[..., :n, :], values[..., :n, :]
        c.keys, c.values = (mx.array(keys), mx.array(values)) if copy else (keys, values)
        c.offset = n
        caches.append(c)
    return caches
