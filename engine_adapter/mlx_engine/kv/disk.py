"""The engine's KV on disk: the tier under the RAM stores, so KV outlives a restart and is
shared by the engine processes of one host.

    <root>/<tier>/ns-<xxh3_64(namespace)>/<h[:2]>/<h>.safetensors      (kv_disk_keys)

One file per entry (``kv_file``: the metadata holds the format version, namespace, model
fingerprint, packed prefix ids, and positions/span of sparse snapshots, all covered by the
file's checksum). An in-memory index (a ``ByteLRU`` of the files' sizes, least recently used
first, with a radix tree of their prefix ids: ``kv_store.PrefixLRU``) is rebuilt at start by a
scan of the headers (``kv_disk_scan``); the conversation store's longest-common-prefix lookup
runs in that tree, in the prompt's length. Every path is reached from the root's held
descriptor without following links (``kv_folder``): nothing outside the folder is read,
written or deleted, and a root that others could write is refused at start.

Writes are write-behind: ``submit`` hands the snapshot to one writer thread through a bounded
queue and returns at once (a full queue drops the write, counted), so the engine thread never
waits for a disk. Loads run on the caller's thread, as a cheaper alternative to a prefill.

Sharing: a file appears whole (temporary name, fsync, rename) or not at all. A process finds
another's files by the scan at its start and, for exact lookups, by probing the file's path; a
file another process evicted is a miss. Each process keeps the folder within ``max_bytes`` as
far as it knows it (its scan and its own writes). A bad file (truncated, corrupt, another
model's, another format version, edited metadata) is deleted when met and costs a recompute.

Faults the writer recovers from by itself: a folder deleted while running is made again at the
next write; a full disk (ENOSPC, EDQUOT) evicts least recently used files down to
``LOW_WATERMARK`` of what the tier holds and tries once more; while writes still fail for
space, ``disk_full`` is reported (stats, ``/metrics``, the engine's readiness report), and the
next write that succeeds clears it. docs/reliability.md has the fault table.
"""

from __future__ import annotations

import errno
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefix_cache.engine.protocol import DiskKVCounts, DiskKVStats, counted
from prefix_cache.util.token_ids import pack_ids, unpack_ids

from ...defaults import DEFAULT_KV_DISK_QUEUE
from . import file as kv_file
from .cache import KVSnapshot
from .disk_keys import DiskEntry, DiskKey, disk_key, disk_rel, namespace_dir
from .disk_scan import remove_dead_temps, scan_folder
from .file import KVFileError
from .folder import TierFolder
from .store import PrefixLRU
from .layered import LayeredSnapshot
from ...purge_marks import PurgeMarks, stamp
from ..mlx_streams import releasing_streams

log = logging.getLogger("engine_adapter.mlx_engine")

DiskSnapshot = KVSnapshot | LayeredSnapshot   # plain KV (dense or sparse), or layered
FLUSH_TIMEOUT_S = 60.0                  # close waits this long for queued writes
LOW_WATERMARK = 0.8                     # a full disk evicts down to this share of the tier
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


@dataclass(slots=True)
class _Write:
    key: DiskKey
    packed_ids: bytes
    snapshot: DiskSnapshot
    supersede: bool
    issued: int    # the stamp of the request the KV comes from (``purge_marks``)


def _new_index(max_bytes: int) -> PrefixLRU[DiskKey, DiskEntry]:
    # One prefix tree per tier, namespace and model: a lookup never walks another's entries.
    return PrefixLRU(max_bytes, lambda key: key[:3], lambda entry: entry.packed_ids)


class DiskKVStore:
    """KV snapshots in files under ``root``, at most ``max_bytes`` of them, for the models whose
    fingerprints are given (model id -> fingerprint); thread-safe."""

    def __init__(self, root: str | Path, max_bytes: int, fingerprints: Mapping[str, str], *,
                 queue_entries: int = DEFAULT_KV_DISK_QUEUE,
                 clock: Callable[[], float] = time.perf_counter,
                 weights_unchanged: Callable[[], bool] | None = None) -> None:
        if not isinstance(max_bytes, int) or max_bytes <= 0:
            raise ValueError(f"max_bytes must be a positive int, got {max_bytes!r}")
        if queue_entries < 1:
            raise ValueError(f"queue_entries must be >= 1, got {queue_entries!r}")
        self.folder = TierFolder(root)   # KVFolderError (a ValueError) names a folder refused
        self.root = self.folder.path
        self.max_bytes = max_bytes
        self.fingerprints = dict(fingerprints)
        self.stats = DiskKVCounts()
        self.owned = False   # made for one engine (``open_kv_disk``): closed with it
        self.disk_full = False   # the last write failed for space, even after evicting
        self._clock = clock
        # Checked at the first use (after the model's load): weights written since they were
        # fingerprinted turn the tier off for this process (kv_fingerprint).
        self._weights_unchanged = weights_unchanged
        self._off = False
        self._index = _new_index(max_bytes)
        self._lock = threading.Lock()
        self._writing_bytes = 0   # the temporary file being written now (counted in bytes)
        # A purge marks its namespace (or all): writes of KV made before it (a write queued,
        # or submitted later for a request issued before it) are dropped instead of bringing
        # purged KV back (``purge_marks``).
        self._purges = PurgeMarks()
        self._queue: queue.Queue[_Write | None] = queue.Queue(queue_entries)
        self.scan()
        self._writer = threading.Thread(target=releasing_streams(self._write_loop),
                                        name="kv-disk-writer",
                                        daemon=True)
        self._writer.start()

    # -- paths and keys ------------------------------------------------------------------------

    key = staticmethod(disk_key)
    rel = staticmethod(disk_rel)

    def path(self, key: DiskKey) -> Path:
        """A key's file as a path (for people and logs: the store itself never follows it)."""
        return self.root / self.rel(key)

    # -- reads (the caller's thread) -----------------------------------------------------------

    def get(self, tier: str, namespace: str, model_id: str,
            prefix_ids: Sequence[int]) -> DiskSnapshot | None:
        """The snapshot for exactly these prefix ids, or None. A file the index does not know
        (another process wrote it since the scan) is found by its path."""
        if not self._usable():
            return None
        packed = pack_ids(prefix_ids)
        key = self.key(tier, namespace, model_id, packed)
        with self._lock:
            entry = self._index.peek(key)
        rel = entry.rel if entry is not None else self.rel(key)
        snap = self._load(key, rel, packed)
        with self._lock:
            if snap is None:
                self.stats.misses += 1
            else:
                self.stats.hits += 1
        return snap

    def longest_common_prefix(self, tier: str, namespace: str, model_id: str,
                              ids: Sequence[int], max_tokens: int, min_tokens: int = 0,
                              *, whole: bool = False,
                              ) -> tuple[int, DiskSnapshot, list[int]] | None:
        """``(n, snapshot, its prefix ids)``: the file of this tier, namespace and model sharing
        the longest prefix with ``ids`` (capped at ``max_tokens``) when longer than
        ``min_tokens``, as ``KVSnapshotStore.longest_common_prefix``; a candidate that fails to
        load is dropped and the next best tried. ``whole``: only files all of whose ids are
        shared (snapshots that restore only whole)."""
        if max_tokens <= min_tokens or not self._usable():
            return None
        packed = pack_ids(ids[:max_tokens])
        while True:
            with self._lock:
                lookup = self._index.longest_whole if whole else self._index.longest
                found = lookup((tier, namespace, model_id), packed)
                if found is None or found[0] <= min_tokens:
                    self.stats.misses += 1
                    return None
            best_n, key, entry = found
            snap = self._load(key, entry.rel, entry.packed_ids)
            if snap is not None:
                with self._lock:
                    self.stats.hits += 1
                return best_n, snap, unpack_ids(entry.packed_ids)

    def _load(self, key: DiskKey, rel: str, packed: bytes) -> DiskSnapshot | None:
        """The file's snapshot if it checks out and holds exactly ``packed``; a bad file (or a
        link, a FIFO in its place) is deleted."""
        start = self._clock()
        try:
            header, snap = kv_file.load(self.folder, rel, self.fingerprints)
            if header.packed_ids != packed or key[:3] != (header.tier, header.namespace,
                                                           header.model_id):
                raise KVFileError("another prefix under this name")
        except FileNotFoundError:
            self._forget(key)
            return None
        except (KVFileError, OSError) as exc:
            log.warning("KV file %s is bad (%s); deleted, its KV is computed again",
                        self.root / rel, exc)
            self._discard(rel, key)
            return None
        try:
            self.folder.touch(rel)   # its last use, for the LRU of processes that scan later
        except OSError:
            pass
        doomed: list[str] = []
        with self._lock:
            self.stats.loads += 1
            self.stats.load_seconds += self._clock() - start
            if self._index.get(key) is None:   # another process's file: indexed now
                doomed = self._add(key, DiskEntry(rel, packed, header.dense_tokens))
        self._delete(doomed)
        return snap

    def _usable(self) -> bool:
        """Whether the tier serves: not once the weights changed while the engine started."""
        check, self._weights_unchanged = self._weights_unchanged, None
        if check is not None and not check():
            log.warning("KV disk %s: the model's weight files changed while the engine "
                        "started; the disk tier is off until a restart", self.root)
            self._off = True
        return not self._off

    def contains(self, tier: str, namespace: str, model_id: str, packed_ids: bytes) -> bool:
        """Whether the index holds exactly these ids (the caller need not write them again)."""
        with self._lock:
            entry = self._index.peek(self.key(tier, namespace, model_id, packed_ids))
            return entry is not None and entry.packed_ids == packed_ids

    # -- writes (the writer thread) ------------------------------------------------------------

    def submit(self, tier: str, namespace: str, model_id: str, prefix_ids: Sequence[int],
               snapshot: DiskSnapshot, *, supersede: bool = False,
               issued: int | None = None) -> bool:
        """Queue a snapshot for writing; False (counted) if the queue is full or the snapshot
        is larger than the whole tier, False (not counted) if its namespace was purged since
        ``issued`` (the stamp of the request it comes from; None: now). Never blocks."""
        if model_id not in self.fingerprints or not self._usable():   # an unknown model, or off
            return False
        packed = pack_ids(prefix_ids)
        if snapshot.nbytes > self.max_bytes:
            with self._lock:
                self.stats.write_drops += 1
            return False
        if self.contains(tier, namespace, model_id, packed):
            return True
        issued = stamp() if issued is None else issued
        with self._lock:
            if self._purges.since(namespace, issued):
                return False
        item = _Write(self.key(tier, namespace, model_id, packed), packed, snapshot, supersede,
                      issued)
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            with self._lock:
                self.stats.write_drops += 1
            return False
        return True

    def flush(self, timeout_s: float = FLUSH_TIMEOUT_S) -> bool:
        """Wait until every queued write is done (at most ``timeout_s``); whether it is."""
        deadline = time.monotonic() + timeout_s
        with self._queue.all_tasks_done:
            while self._queue.unfinished_tasks:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._queue.all_tasks_done.wait(left)
        return True

    def close(self, timeout_s: float = FLUSH_TIMEOUT_S) -> None:
        """Finish the queued writes (at most ``timeout_s``) and stop the writer."""
        if not self._writer.is_alive():
            return
        self.flush(timeout_s)
        try:
            self._queue.put(None, timeout=1.0)
        except queue.Full:
            return  # the writer is stuck in a write; it is a daemon thread
        self._writer.join(timeout_s)

    def release(self) -> None:
        """An engine is done with the store: closed if it was made for it, else flushed."""
        self.close() if self.owned else self.flush()

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._write(item)
            except Exception:  # a failed write costs a later recompute, never the writer
                log.warning("could not write a KV file", exc_info=True)
                with self._lock:
                    self.stats.write_errors += 1
            finally:
                self._queue.task_done()

    def _write(self, item: _Write) -> None:
        tier, namespace, model_id, _ = item.key
        with self._lock:
            if self._purges.since(namespace, item.issued):
                return
        if self.folder.reopen():   # the root was deleted: its files are gone, and the index
            self.scan()
        rel = self.rel(item.key)
        arrays, meta = kv_file.encode(item.snapshot, tier=tier, namespace=namespace,
                                      model_id=model_id,
                                      fingerprint=self.fingerprints[model_id],
                                      packed_ids=item.packed_ids)
        self._write_file(rel, arrays, meta, item.snapshot.nbytes)
        entry = DiskEntry(rel, item.packed_ids, item.snapshot.dense_tokens)
        with self._lock:
            if self._purges.since(namespace, item.issued):  # purged while it was written
                doomed = [rel]
            else:
                self.stats.writes += 1
                doomed = self._add(item.key, entry)
                if item.supersede:
                    covered = self._index.pop_prefixes(item.key[:3], item.packed_ids,
                                                       keep=item.key)
                    doomed += [e.rel for _, e in covered]
        self._delete(doomed)

    def _write_file(self, rel: str, arrays: dict[str, Any], meta: dict[str, str],
                    nbytes: int) -> None:
        """Write one file; on a full disk, make room and try once more (module docstring)."""
        for attempt in (1, 2):
            with self._lock:
                self._writing_bytes = nbytes
            try:
                kv_file.write(self.folder, rel, arrays, meta)
                break
            except OSError as exc:
                if exc.errno not in _NO_SPACE:
                    raise
                if attempt == 2 or not self._make_room(nbytes):
                    with self._lock:
                        self.stats.full_errors += 1
                        self.disk_full = True
                    raise
            finally:
                with self._lock:
                    self._writing_bytes = 0
        with self._lock:
            self.disk_full = False

    def _make_room(self, nbytes: int) -> bool:
        """Delete dead writers' temporary files and the least recently used files down to
        ``LOW_WATERMARK`` of what the tier holds (and ``nbytes`` more); whether any went."""
        removed = remove_dead_temps(self.folder)
        with self._lock:
            target = min(int(self._index.nbytes * LOW_WATERMARK), self._index.nbytes - nbytes)
            doomed: list[str] = []
            while self._index.nbytes > max(target, 0) and (oldest := self._index.oldest()):
                self._index.pop(oldest[0])
                doomed.append(oldest[1].rel)
            self.stats.evictions += len(doomed)
        log.warning("KV disk %s is full: %d files evicted, %d dead temporary files deleted",
                    self.root, len(doomed), removed)
        self._delete(doomed)
        return bool(doomed or removed)

    def _add(self, key: DiskKey, entry: DiskEntry) -> list[str]:
        """Index a file as the most recently used; the files evicted to stay within bounds
        (the caller deletes them, outside the lock). Call with the lock held."""
        try:
            with self.folder.open(entry.rel) as fh:
                size = fh.seek(0, 2)
        except OSError:   # already evicted by another process
            return []
        evicted = self._index.put(key, entry, size)
        if evicted is None:   # larger than the whole tier
            return [entry.rel]
        self.stats.evictions += len(evicted)
        return [e.rel for _, e in evicted]

    def _delete(self, doomed: list[str]) -> None:
        for rel in doomed:
            self.folder.unlink(rel)

    # -- the index -----------------------------------------------------------------------------

    def scan(self) -> int:
        """Rebuild the index from the folder's files, least recently used (oldest mtime) first;
        bad files and dead writers' temporary ones are deleted. The number of files indexed."""
        scan = scan_folder(self.folder, self.fingerprints)
        doomed: list[str] = []
        with self._lock:
            self.stats.discarded += scan.bad
            self._index = _new_index(self.max_bytes)
            for found in scan.found:
                h = found.header
                key = self.key(h.tier, h.namespace, h.model_id, h.packed_ids)
                if self.rel(key) != found.rel:   # not where its metadata says: not ours to trust
                    self.stats.discarded += 1
                    doomed.append(found.rel)
                    continue
                evicted = self._index.put(key, DiskEntry(found.rel, h.packed_ids,
                                                         h.dense_tokens), found.size) or []
                self.stats.evictions += len(evicted)
                doomed += [e.rel for _, e in evicted]
            count = len(self._index)
        self._delete(doomed)
        return count

    def _forget(self, key: DiskKey) -> None:
        with self._lock:
            self._index.pop(key)

    def _discard(self, rel: str, key: DiskKey | None) -> None:
        self.folder.unlink(rel)
        with self._lock:
            self.stats.discarded += 1
            if key is not None:
                self._index.pop(key)

    # -- purges and figures --------------------------------------------------------------------

    def purge(self, tier: str | None = None, namespace: str | None = None) -> int:
        """Delete the files of a tier and a namespace (None: every one), this process's and
        others'; the number of indexed files deleted."""
        with self._lock:
            self._purges.mark(namespace)
            doomed = self._index.pop_where(
                lambda k, _: (tier is None or k[0] == tier)
                and (namespace is None or k[1] == namespace))
        # Whole folders first (other processes' files too), each reached without a link;
        # then what the index says this process wrote, wherever it is below the root.
        tiers = [tier] if tier is not None else self.folder.folders()
        for t in tiers:
            self.folder.remove_tree(t if namespace is None else f"{t}/{namespace_dir(namespace)}")
        self._delete([entry.rel for _, entry in doomed])
        return len(doomed)

    @property
    def nbytes(self) -> int:
        """Bytes of the indexed files and of the temporary file being written."""
        return self._index.nbytes + self._writing_bytes

    def __len__(self) -> int:
        return len(self._index)

    def snapshot_stats(self) -> DiskKVStats:
        """The tier's figures now."""
        with self._lock:
            return DiskKVStats(**counted(self.stats), entries=len(self._index),
                               bytes=self._index.nbytes + self._writing_bytes,
                               max_bytes=self.max_bytes, queued=self._queue.qsize(),
                               disk_full=self.disk_full)
