"""Per-sequence KV caches for the engine: RoPE positions that can run ahead of what is stored,
snapshots of a static prefix, and restores that never share arrays with the store.

After a sparse prefill a sequence stores K of its M prompt tokens, yet its next token must be
rotated at position M. mlx-lm's ``BatchKVCache`` already keeps storage (``_idx``, left padding)
apart from each row's RoPE position (``offset``), and carries ``offset`` through every
extend/filter, so the shift is applied once, when ``BatchGenerator`` merges the per-sequence
caches of newly inserted prompts.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache, RotatingKVCache

from .layered import (
    LayeredSnapshot,
    restore_layers,
    snapshot_layers,
    supports_layered_cache,
    window_at,
)


class PositionedKVCache(KVCache):
    """A ``KVCache`` whose row, once merged into a batch, is rotated ``position_shift`` ahead.

    Used on its own, it behaves exactly as ``KVCache`` (the shift only takes effect in
    ``merge``); the engine sets the shift after a sparse prefill, just before insertion.
    Models with other layers too get it for their full-attention layers: ``BatchGenerator``
    merges a layer with its first row's class, so every row must be one.
    """

    plain_kv = True   # a KVCache to a layered snapshot (``layered``)

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
    """Keys and values of the first ``n_tokens`` stored tokens of a sequence, one pair per layer.

    A dense snapshot stores prompt positions ``0 .. n_tokens - 1``. A sparse one (a
    SpecPrefill's KV) stores only some: ``positions`` says each stored token's prompt position
    (increasing), ``span`` how many prompt tokens the snapshot stands for, and ``keep_pct`` the
    keep share its dropped tokens were chosen at (None: not known, so its sparse part serves
    no request). ``reply_from``: where a finished sequence's generated tokens start.
    """

    layers: tuple[tuple[mx.array, mx.array], ...]
    n_tokens: int
    nbytes: int
    positions: tuple[int, ...] | None = None
    span: int | None = None
    keep_pct: float | None = None
    reply_from: int | None = None   # stored ids from here on were generated (``reply``)
    trimmable = True    # restores any leading part (``LayeredSnapshot``: only the whole)

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens the snapshot stands for (stored or, when sparse, dropped)."""
        return self.n_tokens if self.span is None else self.span

    @property
    def dense_tokens(self) -> int:
        """The leading prompt tokens all stored (a sparse snapshot's protected part)."""
        p = self.positions
        if p is None:
            return self.n_tokens
        # Positions increase, so p[i] >= i, and p[i] == i exactly up to the first gap.
        return bisect_left(range(len(p)), True, key=lambda i: p[i] != i)

    def stored_before(self, n: int) -> int:
        """Stored tokens among the first ``n`` prompt positions."""
        return min(n, self.n_tokens) if self.positions is None else bisect_left(self.positions, n)

    def positions_before(self, n: int) -> tuple[int, ...] | None:
        """The stored positions among the first ``n`` (None: dense, all of them)."""
        return None if self.positions is None else self.positions[:self.stored_before(n)]


def supports_positioned_cache(model: Any) -> bool:
    """Plain full-attention models only: their KV can be stored sparse, trimmed and rotated
    ahead (SpecPrefill). A model whose own caches are anything else (sliding windows,
    recurrent layers) keeps them; see ``supports_reuse``."""
    if not hasattr(model, "layers"):
        return False
    make = getattr(model, "make_cache", None)
    return make is None or all(type(c) is KVCache for c in make())


def supports_reuse(model: Any) -> bool:
    """Whether the engine can snapshot and restore the model's caches: plain KV, or a mix of
    full, sliding-window and recurrent layers (``layered``); not quantized or chunked ones."""
    if supports_positioned_cache(model):
        return True
    make = getattr(model, "make_cache", None)
    return make is not None and supports_layered_cache(make())


def make_cache(model: Any) -> list[Any]:
    """A fresh per-sequence cache for ``model``."""
    if hasattr(model, "make_cache") and not supports_positioned_cache(model):
        return _positioned(model.make_cache())
    return [PositionedKVCache() for _ in model.layers]


def _positioned(cache: list[Any]) -> list[Any]:
    """Full-attention layers as ``PositionedKVCache`` (the same state), the others as they are."""
    out = []
    for c in cache:
        if type(c) is KVCache:
            p = PositionedKVCache()
            p.keys, p.values, p.offset = c.keys, c.values, c.offset
            c = p
        out.append(c)
    return out


def rotate_ahead(cache: list[Any], n_tokens: int) -> list[Any]:
    """A layered model's cache after a sparse prefill, standing for ``n_tokens`` prompt tokens:
    full-attention layers rotated ahead by the dropped tokens, sliding-window layers as a dense
    window (``layered.window_at``), recurrent layers as they are (their state is the kept
    tokens' own: approximate)."""
    out = []
    for c in _positioned(cache):
        if isinstance(c, PositionedKVCache):
            c.position_shift = n_tokens - c.offset
        elif type(c) is RotatingKVCache:
            c = window_at(c, n_tokens)
        out.append(c)
    return out


def cache_size(cache: Sequence[Any]) -> int:
    """Tokens stored in a per-sequence cache (read off its first attention layer: a recurrent
    layer does not count them)."""
    return next((int(c.offset) for c in cache if hasattr(c, "offset")), 0)


def snapshot(cache: Sequence[Any], n_tokens: int, *,
             positions: Sequence[int] | None = None, span: int | None = None,
             keep_pct: float | None = None) -> KVSnapshot | LayeredSnapshot:
    """Copy of the first ``n_tokens`` stored tokens of a per-sequence cache, evaluated; with
    ``positions`` (one per stored token, increasing), ``span`` and ``keep_pct``, a sparse
    snapshot. A cache with other layers than plain KV must hold exactly ``n_tokens``: a
    ``LayeredSnapshot``."""
    if any(type(c) not in (KVCache, PositionedKVCache) for c in cache):
        if positions is not None:
            raise ValueError("only plain KV caches are stored sparse")
        return snapshot_layers(cache, n_tokens)
    if any(c.keys is None or c.offset < n_tokens for c in cache):
        raise ValueError(f"cache holds fewer than {n_tokens} tokens")
    if positions is not None:
        positions = tuple(positions)
        span = positions[-1] + 1 if span is None and positions else span
        if len(positions) != n_tokens or span is None or (positions and positions[-1] >= span) \
                or any(b <= a for a, b in zip(positions, positions[1:], strict=False)):
            raise ValueError("a sparse snapshot needs one increasing position per stored "
                             "token, all before its span")
    layers = tuple(
        (mx.contiguous(c.keys[..., :n_tokens, :]), mx.contiguous(c.values[..., :n_tokens, :]))
        for c in cache if c.keys is not None and c.values is not None
    )
    mx.eval(layers)
    nbytes = sum(k.nbytes + v.nbytes for k, v in layers)
    if positions is None:
        return KVSnapshot(layers, n_tokens, nbytes)
    return KVSnapshot(layers, n_tokens, nbytes, positions, span, keep_pct)


def restore(snap: KVSnapshot | LayeredSnapshot, n_tokens: int | None = None, *,
            copy: bool = True) -> list[Any]:
    """A new per-sequence cache standing for the snapshot's first ``n_tokens`` prompt tokens
    (all by default). From a sparse snapshot it holds the stored ones among them and is
    rotated ahead by the dropped ones (``position_shift``), so what follows sits at position
    ``n_tokens``.

    With ``copy`` (the default) its arrays are copies, so later writes into the cache (slice
    assignment after a trim, say) never reach the store: what a cache that is prefilled in
    place needs. ``copy=False`` gives read-only views, for a cache handed straight to
    ``BatchGenerator.insert``: merging it into the batch copies it anyway, and a second copy
    before that would only cost time to first token."""
    if isinstance(snap, LayeredSnapshot):
        return _positioned(restore_layers(snap, n_tokens, copy=copy))
    span = snap.prompt_tokens
    want = span if n_tokens is None else n_tokens
    n = snap.stored_before(want)
    if not 0 < want <= span or n == 0:
        raise ValueError(f"cannot restore {want} tokens from a snapshot of {span}")
    caches = []
    for keys, values in snap.layers:
        c = PositionedKVCache(position_shift=want - n)
        if n < snap.n_tokens:
            keys, values = keys[..., :n, :], values[..., :n, :]
        c.keys, c.values = (mx.array(keys), mx.array(values)) if copy else (keys, values)
        c.offset = n
        caches.append(c)
    return caches
