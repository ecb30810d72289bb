"""The static-prefix KV store: an LRU bounded in bytes, namespaced, keyed by exact prefix ids.

    key = (namespace, model_id, xxh3_128(prefix ids as uint32))

A namespace (tenant) never reads another's entry, even for the same prefix ids: a shared entry
would leak through time to first token what another tenant sent. The model id keeps the target's
and the draft's KV apart. Entries keep their packed ids and are compared on every hit, so even a
colliding hash cannot hand out the KV of other tokens. No mlx import: a snapshot is opaque here
(anything with ``nbytes``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import xxhash

from prefix_cache.boundary import packed_prefix_len
from prefix_cache.engine_protocol import KVStoreCounts, KVStoreStats, counted
from prefix_cache.lru import ByteLRU
from prefix_cache.token_ids import pack_ids

from ..defaults import DEFAULT_KV_BYTES

log = logging.getLogger("engine_adapter.mlx_engine")


class Snapshot(Protocol):
    """What the store holds: a KV snapshot that knows its size."""

    @property
    def nbytes(self) -> int: ...


Key = tuple[str, str, bytes]


@dataclass(slots=True)
class _Entry:
    packed_ids: bytes
    snapshot: Any


def prefix_key(namespace: str, model_id: str, prefix_ids: Sequence[int]) -> tuple[Key, bytes]:
    """The store key for these exact prefix ids, and the packed ids it is checked against."""
    packed = pack_ids(prefix_ids)
    return (namespace, model_id, xxhash.xxh3_128_digest(packed)), packed


class KVSnapshotStore:
    """LRU of static-prefix KV snapshots, at most ``max_bytes`` in all; thread-safe."""

    def __init__(self, max_bytes: int = DEFAULT_KV_BYTES) -> None:
        if not isinstance(max_bytes, int) or max_bytes <= 0:
            raise ValueError(f"max_bytes must be a positive int, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self.stats = KVStoreCounts()
        self._entries: ByteLRU[Key, _Entry] = ByteLRU(max_bytes)
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return self._entries.nbytes

    def __len__(self) -> int:
        return len(self._entries)

    def snapshot_stats(self) -> KVStoreStats:
        """The store's figures now."""
        with self._lock:
            return KVStoreStats(**counted(self.stats), entries=len(self._entries),
                                bytes=self._entries.nbytes, max_bytes=self.max_bytes)

    def get(self, namespace: str, model_id: str, prefix_ids: Sequence[int]) -> Any | None:
        """The snapshot for exactly these prefix ids in this namespace, or None."""
        key, packed = prefix_key(namespace, model_id, prefix_ids)
        with self._lock:
            entry = self._entries.peek(key)
            if entry is None or entry.packed_ids != packed:
                self.stats.misses += 1
                return None
            self._entries.get(key)  # now the most recently used
            self.stats.hits += 1
            return entry.snapshot

    def longest_common_prefix(self, namespace: str, model_id: str, ids: Sequence[int],
                              max_tokens: int, min_tokens: int = 0, *,
                              whole: bool = False) -> tuple[int, Any] | None:
        """``(n, snapshot)``: the entry of this namespace and model that shares the longest
        prefix with ``ids`` (exact comparison), with ``n`` that shared length capped at
        ``max_tokens``, when ``n > min_tokens``; else None.

        The entry may be longer than ``n`` (an earlier sibling prompt: a retried or edited last
        turn, another agent on the same history): the KV of its first ``n`` tokens depends on
        those tokens alone, so the caller restores just them (mlx_lm.server's prompt cache
        trims the same way). The conversation store's lookup: a scan of the namespace's entries
        in recency order, each a memcmp binary search on the packed ids (4 bytes per id, so a
        byte prefix is a token prefix); the most recent entry wins a tie. ``whole``: only
        entries all of whose ids are shared (snapshots that restore only whole)."""
        if max_tokens <= min_tokens:
            return None
        packed = pack_ids(ids[:max_tokens])
        with self._lock:
            best: tuple[Key, _Entry] | None = None
            best_n = min_tokens
            for key, entry in reversed(list(self._entries.items())):
                if key[0] != namespace or key[1] != model_id:
                    continue
                n = packed_prefix_len(packed, entry.packed_ids)
                if n > best_n and not (whole and 4 * n != len(entry.packed_ids)):
                    best, best_n = (key, entry), n
            if best is None:
                self.stats.misses += 1
                return None
            self._entries.get(best[0])
            self.stats.hits += 1
            return best_n, best[1].snapshot

    def put(self, namespace: str, model_id: str, prefix_ids: Sequence[int],
            snapshot: Snapshot, *, supersede: bool = False) -> bool:
        """Store a snapshot, evicting least recently used entries; False if it cannot fit.

        ``supersede`` also drops the entries of this namespace and model whose ids are a proper
        prefix of these: for ``longest_common_prefix`` lookups (the conversation store) the new
        entry shares at least as long a prefix with any prompt as they do, so a conversation
        keeps one entry, its latest turn, instead of one per turn. Never for exact ``get``s."""
        size = int(snapshot.nbytes)
        key, packed = prefix_key(namespace, model_id, prefix_ids)
        with self._lock:
            if size > self.max_bytes:
                self.stats.rejected += 1
                if self.stats.rejected == 1:  # once: it repeats for every such prefix
                    log.warning("a KV snapshot of %d bytes is larger than the whole store (%d "
                                "bytes) and is not kept; raise the store's size (engine option "
                                "kv_bytes or conversation_bytes)", size, self.max_bytes)
                return False
            if self._entries.pop(key) is not None:
                self._count(key, -1)
            if supersede:
                covered = self._entries.pop_where(
                    lambda k, e: k[0] == namespace and k[1] == model_id
                    and packed.startswith(e.packed_ids))
                for k, _ in covered:
                    self._count(k, -1)
                self.stats.superseded += len(covered)
            evicted = self._entries.put(key, _Entry(packed, snapshot), size) or []
            for k, _ in evicted:
                self._count(k, -1)
            self.stats.evictions += len(evicted)
            self._count(key, +1)
            self.stats.puts += 1
            return True

    def purge(self, namespace: str | None = None) -> int:
        """Drop every entry (of one namespace, when given); the number dropped."""
        with self._lock:
            doomed = self._entries.pop_where(lambda k, _: namespace is None or k[0] == namespace)
            for k, _ in doomed:
                self._count(k, -1)
            return len(doomed)

    def _count(self, key: Key, delta: int) -> None:
        ns = self.stats.by_namespace
        ns[key[0]] = ns.get(key[0], 0) + delta
        if not ns[key[0]]:
            del ns[key[0]]
