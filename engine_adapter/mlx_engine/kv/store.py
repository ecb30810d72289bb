"""The static-prefix KV store: an LRU bounded in bytes, namespaced, keyed by exact prefix ids,
with a prefix index for longest-prefix lookups.

    key = (namespace, model_id, xxh3_128(prefix ids as uint32))

A namespace (tenant) never reads another's entry, even for the same prefix ids: a shared entry
would leak through time to first token what another tenant sent. The model id keeps the target's
and the draft's KV apart. Entries keep their packed ids and are compared on every hit, so even a
colliding hash cannot hand out the KV of other tokens. No mlx import: a snapshot is opaque here
(anything with ``nbytes``).

The longest stored prefix of a prompt is found in a radix tree over the entries' packed ids, one
tree per scope (namespace and model; the disk tier adds its tier), so it costs in the prompt's
length, not in the number of entries (``PrefixIndex``; ``PrefixLRU`` keeps it in step with the
LRU, the disk tier's index included).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import xxhash

from prefix_cache.cache.boundary import packed_prefix_len
from prefix_cache.engine.protocol import KVStoreCounts, KVStoreStats, counted
from prefix_cache.util.lru import ByteLRU
from prefix_cache.util.token_ids import pack_ids

from ...defaults import DEFAULT_KV_BYTES
from ...purge_marks import PurgeMarks

log = logging.getLogger("engine_adapter.mlx_engine")

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")
WIDTH = 4   # bytes per packed id: a byte prefix on a multiple of it is a token prefix


class _Node:
    """A radix tree node: the packed ids on the edge from its parent, its children by their
    edge's first id, the entry ending here, and the most recently used entry below it."""

    __slots__ = ("edge", "children", "end", "latest")

    def __init__(self, edge: bytes) -> None:
        self.edge = edge
        self.children: dict[bytes, _Node] = {}
        self.end: Hashable | None = None
        self.latest: tuple[int, Hashable] | None = None   # (use stamp, key)


class PrefixIndex(Generic[K]):
    """Entries' packed ids in a radix tree per scope: the entry sharing the longest prefix with
    a prompt (the most recently used on a tie) in the prompt's length; not thread-safe."""

    def __init__(self) -> None:
        self._roots: dict[Hashable, _Node] = {}
        self._where: dict[K, tuple[Hashable, bytes]] = {}
        self._stamps: dict[K, int] = {}
        self._clock = 0

    def __len__(self) -> int:
        return len(self._where)

    def insert(self, key: K, scope: Hashable, packed: bytes) -> None:
        """Index ``key`` (not indexed yet) as holding ``packed``, now the most recently used."""
        self._where[key] = (scope, packed)
        mark = self._tick(key)
        node = self._roots.setdefault(scope, _Node(b""))
        pos = 0
        while True:
            node.latest = mark
            if pos == len(packed):
                node.end = key
                return
            child = node.children.get(packed[pos:pos + WIDTH])
            if child is None:
                leaf = node.children[packed[pos:pos + WIDTH]] = _Node(packed[pos:])
                leaf.end, leaf.latest = key, mark
                return
            if not packed.startswith(child.edge, pos):   # split the edge where they part
                cut = WIDTH * packed_prefix_len(packed[pos:pos + len(child.edge)], child.edge)
                mid = node.children[packed[pos:pos + WIDTH]] = _Node(child.edge[:cut])
                child.edge = child.edge[cut:]
                mid.children[child.edge[:WIDTH]] = child
                child = mid
            pos += len(child.edge)
            node = child

    def touch(self, key: K) -> None:
        """Make ``key`` the most recently used (ties go to it)."""
        mark = self._tick(key)
        for node in self._path(key):
            node.latest = mark

    def remove(self, key: K) -> None:
        """Forget ``key`` (nothing when it is not indexed)."""
        if key not in self._where:
            return
        path = self._path(key)
        scope, packed = self._where.pop(key)
        del self._stamps[key]
        path[-1].end = None
        for parent, node in zip(reversed(path[:-1]), reversed(path[1:]), strict=True):
            if node.end is None and not node.children:
                del parent.children[node.edge[:WIDTH]]
            elif node.end is None and len(node.children) == 1:   # keep edges compressed
                (only,) = node.children.values()
                only.edge = node.edge + only.edge
                parent.children[node.edge[:WIDTH]] = only
        root = path[0]
        if root.end is None and not root.children:
            del self._roots[scope]
            return
        for node in reversed(self._walk(root, packed)):
            if node.latest is not None and node.latest[1] == key:
                node.latest = self._latest_below(node)

    def longest(self, scope: Hashable, packed: bytes) -> tuple[int, K] | None:
        """``(n, key)``: the most recently used entry of ``scope`` among those sharing the
        longest prefix with ``packed``, ``n`` ids long; None when none shares one."""
        node = self._roots.get(scope)
        if node is None:
            return None
        pos = 0
        while pos < len(packed):
            child = node.children.get(packed[pos:pos + WIDTH])
            if child is None:
                break
            node = child
            if not packed.startswith(child.edge, pos):   # they part inside this edge
                pos += WIDTH * packed_prefix_len(packed[pos:pos + len(child.edge)], child.edge)
                break
            pos += len(child.edge)
        if pos == 0 or node.latest is None:
            return None
        return pos // WIDTH, node.latest[1]  # type: ignore[return-value]

    def prefixes(self, scope: Hashable, packed: bytes) -> list[K]:
        """The keys of ``scope`` whose ids are a prefix of ``packed`` (equal included)."""
        root = self._roots.get(scope)
        if root is None:
            return []
        return [n.end for n in self._walk(root, packed) if n.end is not None]  # type: ignore[misc]

    def _tick(self, key: K) -> tuple[int, Hashable]:
        self._clock += 1
        self._stamps[key] = self._clock
        return self._clock, key

    def _path(self, key: K) -> list[_Node]:
        scope, packed = self._where[key]
        return self._walk(self._roots[scope], packed)

    @staticmethod
    def _walk(root: _Node, packed: bytes) -> list[_Node]:
        """The nodes from ``root`` whose ids are a prefix of ``packed``, root first."""
        path, node, pos = [root], root, 0
        while pos < len(packed):
            child = node.children.get(packed[pos:pos + WIDTH])
            if child is None or not packed.startswith(child.edge, pos):
                break
            path.append(child)
            node, pos = child, pos + len(child.edge)
        return path

    def _latest_below(self, node: _Node) -> tuple[int, Hashable] | None:
        marks = [c.latest for c in node.children.values() if c.latest is not None]
        if node.end is not None:
            marks.append((self._stamps[node.end], node.end))  # type: ignore[index]
        return max(marks, key=lambda m: m[0], default=None)


class PrefixLRU(ByteLRU[K, V]):
    """A ``ByteLRU`` whose values hold packed ids, with a ``PrefixIndex`` kept in step (puts,
    evictions, pops, uses): ``scope(key)`` names the tree a key belongs to."""

    def __init__(self, max_bytes: int, scope: Callable[[K], Hashable],
                 ids: Callable[[V], bytes]) -> None:
        super().__init__(max_bytes)
        self.index: PrefixIndex[K] = PrefixIndex()
        self._scope = scope
        self._ids = ids

    def get(self, key: K) -> V | None:
        value = super().get(key)
        if value is not None:
            self.index.touch(key)
        return value

    def put(self, key: K, value: V, size: int) -> list[tuple[K, V]] | None:
        evicted = super().put(key, value, size)   # pops ``key`` first: out of the index too
        if evicted is None:
            return None
        for old, _ in evicted:
            self.index.remove(old)
        self.index.insert(key, self._scope(key), self._ids(value))
        return evicted

    def pop(self, key: K) -> V | None:
        value = super().pop(key)
        if value is not None:
            self.index.remove(key)
        return value

    def longest(self, scope: Hashable, packed: bytes) -> tuple[int, K, V] | None:
        """``(n, key, value)``: the entry of ``scope`` sharing the longest prefix with
        ``packed`` (the most recently used on a tie), left where it is in the LRU."""
        found = self.index.longest(scope, packed)
        if found is None:
            return None
        value = self.peek(found[1])
        return None if value is None else (found[0], found[1], value)

    def longest_whole(self, scope: Hashable, packed: bytes) -> tuple[int, K, V] | None:
        """``(n, key, value)``: the entry of ``scope`` whose ids are the longest prefix of
        ``packed`` (all of them shared: a snapshot that restores only whole)."""
        for key in reversed(self.index.prefixes(scope, packed)):
            value = self.peek(key)
            if value is not None:
                return len(self._ids(value)) // WIDTH, key, value
        return None

    def pop_prefixes(self, scope: Hashable, packed: bytes,
                     keep: K | None = None) -> list[tuple[K, V]]:
        """Remove the entries of ``scope`` whose ids are a prefix of ``packed`` (but ``keep``)."""
        popped = []
        for key in self.index.prefixes(scope, packed):
            value = None if key == keep else self.pop(key)
            if value is not None:
                popped.append((key, value))
        return popped


def _scope(key: Key) -> Hashable:
    return key[:2]   # namespace, model id


def _entry_ids(entry: _Entry) -> bytes:
    return entry.packed_ids


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
        self._entries: PrefixLRU[Key, _Entry] = PrefixLRU(max_bytes, _scope, _entry_ids)
        self._purges = PurgeMarks()
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return self._entries.nbytes

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def indexed(self) -> int:
        """Entries the radix tree holds: ``len(self)`` while the two are in step."""
        return len(self._entries.index)

    def entries(self) -> list[tuple[str, str, bytes, Any]]:
        """Every entry as (namespace, model, packed ids, snapshot), least recently used
        first: a read-only listing that uses no entry."""
        with self._lock:
            return [(k[0], k[1], e.packed_ids, e.snapshot) for k, e in self._entries.items()]

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
        trims the same way). The conversation store's lookup, in the prompt's length (the
        radix tree), whatever the number of entries. ``whole``: only entries all of whose ids
        the prompt holds (snapshots that restore only whole)."""
        if max_tokens <= min_tokens:
            return None
        packed = pack_ids(ids[:max_tokens])
        with self._lock:
            lookup = self._entries.longest_whole if whole else self._entries.longest
            found = lookup((namespace, model_id), packed)
            if found is None or found[0] <= min_tokens:
                self.stats.misses += 1
                return None
            n, key, entry = found
            self._entries.get(key)  # now the most recently used
            self.stats.hits += 1
            return n, entry.snapshot

    def put(self, namespace: str, model_id: str, prefix_ids: Sequence[int],
            snapshot: Snapshot, *, supersede: bool = False, issued: int | None = None) -> bool:
        """Store a snapshot, evicting least recently used entries; False if it cannot fit, or
        if its namespace was purged after ``issued`` (the ``purge_marks`` stamp of the request
        the KV comes from: what a request made before a purge computes is never stored after
        it; None: always stored).

        ``supersede`` also drops the entries of this namespace and model whose ids are a proper
        prefix of these: for ``longest_common_prefix`` lookups (the conversation store) the new
        entry shares at least as long a prefix with any prompt as they do, so a conversation
        keeps one entry, its latest turn, instead of one per turn. Never for exact ``get``s."""
        size = int(snapshot.nbytes)
        key, packed = prefix_key(namespace, model_id, prefix_ids)
        with self._lock:
            if self._purges.since(namespace, issued):
                return False
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
                covered = self._entries.pop_prefixes((namespace, model_id), packed)
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
        """Drop every entry (of one namespace, when given); the number dropped. Puts of KV
        issued before it are refused from now on (``put``)."""
        with self._lock:
            self._purges.mark(namespace)
            doomed = self._entries.pop_where(lambda k, _: namespace is None or k[0] == namespace)
            for k, _ in doomed:
                self._count(k, -1)
            return len(doomed)

    def _count(self, key: Key, delta: int) -> None:
        ns = self.stats.by_namespace
        ns[key[0]] = ns.get(key[0], 0) + delta
        if not ns[key[0]]:
            del ns[key[0]]
