"""A RAM KV store over the disk tier: lookups go RAM, then disk (a disk hit is promoted to RAM),
then the caller computes; every put also goes to disk, written behind by the disk's writer.

A ``KVSnapshotStore`` itself, so the engine and its reuse policy use it unchanged; the RAM
lookups are the store's own (this class adds the disk around them, it does not replace them).
Writing at put time (rather than at eviction from RAM) is what lets the KV outlive a crash; a
put is already after the first token for prompts (``KVReuse.on_first_token``), and ``submit``
never blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .disk import DiskKVStore
from .store import KVSnapshotStore, Snapshot
from ...purge_marks import stamp


class TieredKVStore(KVSnapshotStore):
    """A ``KVSnapshotStore`` of ``max_bytes`` in RAM whose entries also live in ``disk`` (under
    ``tier``: "static" or "conversation")."""

    def __init__(self, max_bytes: int, disk: DiskKVStore, tier: str) -> None:
        super().__init__(max_bytes)
        self.disk = disk
        self.tier = tier

    def get(self, namespace: str, model_id: str, prefix_ids: Sequence[int]) -> Any | None:
        snap = super().get(namespace, model_id, prefix_ids)
        if snap is not None:
            return snap
        issued = stamp()   # a purge while the file is read: not promoted into RAM after it
        snap = self.disk.get(self.tier, namespace, model_id, prefix_ids)
        if snap is not None:
            super().put(namespace, model_id, prefix_ids, snap, issued=issued)   # promoted
        return snap

    def longest_common_prefix(self, namespace: str, model_id: str, ids: Sequence[int],
                              max_tokens: int, min_tokens: int = 0, *,
                              whole: bool = False) -> tuple[int, Any] | None:
        """The longer of RAM's and disk's longest common prefix (RAM's on a tie: no read)."""
        issued = stamp()
        ram = super().longest_common_prefix(namespace, model_id, ids, max_tokens, min_tokens,
                                            whole=whole)
        floor = ram[0] if ram is not None else min_tokens
        disk = self.disk.longest_common_prefix(self.tier, namespace, model_id, ids, max_tokens,
                                               floor, whole=whole)
        if disk is None:
            return ram
        n, snap, entry_ids = disk
        super().put(namespace, model_id, entry_ids, snap, supersede=True, issued=issued)
        return n, snap

    def put(self, namespace: str, model_id: str, prefix_ids: Sequence[int],
            snapshot: Snapshot, *, supersede: bool = False, issued: int | None = None) -> bool:
        # Each tier checks ``issued`` against its own purges, under its own lock: a purge
        # between the two finds the RAM entry to drop, then refuses the write.
        stored = super().put(namespace, model_id, prefix_ids, snapshot, supersede=supersede,
                             issued=issued)
        self.disk.submit(self.tier, namespace, model_id, prefix_ids, snapshot,  # type: ignore[arg-type]
                         supersede=supersede, issued=issued)
        return stored

    def purge(self, namespace: str | None = None) -> int:
        """Drop the entries of a namespace (or all) in RAM and on disk; the number dropped."""
        return super().purge(namespace) + self.disk.purge(self.tier, namespace)


def tiered(store: KVSnapshotStore | None, disk: DiskKVStore | None,
           tier: str) -> KVSnapshotStore | None:
    """``store`` over ``disk``: a ``TieredKVStore`` of the same RAM size (the given store is
    replaced, so give an empty one); unchanged when there is no disk or no store."""
    if store is None or disk is None or isinstance(store, TieredKVStore):
        return store
    return TieredKVStore(store.max_bytes, disk, tier)
