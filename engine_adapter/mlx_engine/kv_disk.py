"""The engine's KV on disk: the tier under the RAM stores, so KV outlives a restart and is
shared by the engine processes of one host.

    <root>/<tier>/ns-<xxh3_64(namespace)>/<h[:2]>/<h>.safetensors
        h = xxh3_128(tier, namespace, model id, xxh3_128(packed prefix ids))

One file per entry (``kv_file``: the metadata holds the format version, namespace, model
fingerprint, packed prefix ids, and positions/span of sparse snapshots). An in-memory index
(a ``ByteLRU`` of the files' sizes, least recently used first) is rebuilt at start by a scan
of the headers; the conversation store's longest-common-prefix lookup runs over it.

Writes are write-behind: ``submit`` hands the snapshot to one writer thread through a bounded
queue and returns at once (a full queue drops the write, counted), so the engine thread never
waits for a disk. Loads run on the caller's thread, as a cheaper alternative to a prefill.

Sharing: a file appears whole (temporary name, fsync, rename) or not at all. A process finds
another's files by the scan at its start and, for exact lookups, by probing the file's path; a
file another process evicted is a miss. Each process keeps the folder within ``max_bytes`` as
far as it knows it (its scan and its own writes). A bad file (truncated, corrupt, another
model's, another format version) is deleted when met and costs a recompute.
"""

from __future__ import annotations

import logging
import os
import queue
import shutil
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import xxhash

from prefix_cache.boundary import packed_prefix_len
from prefix_cache.engine_protocol import DiskKVCounts, DiskKVStats, counted
from prefix_cache.lru import ByteLRU
from prefix_cache.token_ids import pack_ids, unpack_ids

from ..defaults import DEFAULT_KV_DISK_QUEUE
from . import kv_file
from .kv_cache import KVSnapshot
from .kv_file import KVFileError
from .streams import releasing_streams

log = logging.getLogger("engine_adapter.mlx_engine")

DiskKey = tuple[str, str, str, bytes]   # tier, namespace, model id, xxh3_128(packed ids)
STALE_TMP_S = 3600.0                    # a temporary file this old is a crashed writer's
FLUSH_TIMEOUT_S = 60.0                  # close waits this long for queued writes


@dataclass(frozen=True, slots=True)
class DiskEntry:
    """A file the index knows: where it is and the prefix ids it holds."""

    path: Path
    packed_ids: bytes
    dense_tokens: int


@dataclass(slots=True)
class _Write:
    key: DiskKey
    packed_ids: bytes
    snapshot: KVSnapshot
    supersede: bool
    generation: int


def _namespace_dir(namespace: str) -> str:
    return f"ns-{xxhash.xxh3_64_hexdigest(namespace.encode())}"


class DiskKVStore:
    """KV snapshots in files under ``root``, at most ``max_bytes`` of them, for the models whose
    fingerprints are given (model id -> fingerprint); thread-safe."""

    def __init__(self, root: str | Path, max_bytes: int, fingerprints: Mapping[str, str], *,
                 queue_entries: int = DEFAULT_KV_DISK_QUEUE,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        if not isinstance(max_bytes, int) or max_bytes <= 0:
            raise ValueError(f"max_bytes must be a positive int, got {max_bytes!r}")
        if queue_entries < 1:
            raise ValueError(f"queue_entries must be >= 1, got {queue_entries!r}")
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.max_bytes = max_bytes
        self.fingerprints = dict(fingerprints)
        self.stats = DiskKVCounts()
        self.owned = False   # made for one engine (``open_kv_disk``): closed with it
        self._clock = clock
        self._index: ByteLRU[DiskKey, DiskEntry] = ByteLRU(max_bytes)
        self._lock = threading.Lock()
        # A purge bumps the generation of its namespace (or all): queued writes made before it
        # are dropped instead of bringing purged KV back.
        self._generation = 0
        self._purged_at: dict[str | None, int] = {}
        self._queue: queue.Queue[_Write | None] = queue.Queue(queue_entries)
        self.scan()
        self._writer = threading.Thread(target=releasing_streams(self._write_loop),
                                        name="kv-disk-writer",
                                        daemon=True)
        self._writer.start()

    # -- paths and keys ------------------------------------------------------------------------

    @staticmethod
    def key(tier: str, namespace: str, model_id: str, packed_ids: bytes) -> DiskKey:
        return (tier, namespace, model_id, xxhash.xxh3_128_digest(packed_ids))

    def path(self, key: DiskKey) -> Path:
        tier, namespace, model_id, digest = key
        h = xxhash.xxh3_128_hexdigest(b"\0".join(
            (tier.encode(), namespace.encode(), model_id.encode(), digest)))
        return self.root / tier / _namespace_dir(namespace) / h[:2] / f"{h}{kv_file.SUFFIX}"

    # -- reads (the caller's thread) -----------------------------------------------------------

    def get(self, tier: str, namespace: str, model_id: str,
            prefix_ids: Sequence[int]) -> KVSnapshot | None:
        """The snapshot for exactly these prefix ids, or None. A file the index does not know
        (another process wrote it since the scan) is found by its path."""
        packed = pack_ids(prefix_ids)
        key = self.key(tier, namespace, model_id, packed)
        with self._lock:
            entry = self._index.peek(key)
        path = entry.path if entry is not None else self.path(key)
        snap = self._load(key, path, packed, known=entry is not None)
        with self._lock:
            if snap is None:
                self.stats.misses += 1
            else:
                self.stats.hits += 1
        return snap

    def longest_common_prefix(self, tier: str, namespace: str, model_id: str,
                              ids: Sequence[int], max_tokens: int, min_tokens: int = 0,
                              ) -> tuple[int, KVSnapshot, list[int]] | None:
        """``(n, snapshot, its prefix ids)``: the file of this tier, namespace and model sharing
        the longest prefix with ``ids`` (capped at ``max_tokens``) when longer than
        ``min_tokens``, as ``KVSnapshotStore.longest_common_prefix``; a candidate that fails to
        load is dropped and the next best tried."""
        if max_tokens <= min_tokens:
            return None
        packed = pack_ids(ids[:max_tokens])
        while True:
            with self._lock:
                best: tuple[DiskKey, DiskEntry] | None = None
                best_n = min_tokens
                for key, entry in reversed(list(self._index.items())):
                    if key[:3] != (tier, namespace, model_id):
                        continue
                    n = packed_prefix_len(packed, entry.packed_ids)
                    if n > best_n:
                        best, best_n = (key, entry), n
                if best is None:
                    self.stats.misses += 1
                    return None
            key, entry = best
            snap = self._load(key, entry.path, entry.packed_ids, known=True)
            if snap is not None:
                with self._lock:
                    self.stats.hits += 1
                return best_n, snap, unpack_ids(entry.packed_ids)

    def _load(self, key: DiskKey, path: Path, packed: bytes, *, known: bool) -> KVSnapshot | None:
        """The file's snapshot if it holds exactly ``packed``; a bad file is deleted."""
        if not known and not path.exists():
            return None
        start = self._clock()
        try:
            header, snap = kv_file.load(path, self.fingerprints)
            if header.packed_ids != packed or key[:3] != (header.tier, header.namespace,
                                                           header.model_id):
                raise KVFileError("another prefix under this name")
        except FileNotFoundError:
            self._forget(key)
            return None
        except (KVFileError, OSError) as exc:
            log.warning("KV file %s is bad (%s); deleted, its KV is computed again", path, exc)
            self._discard(path, key)
            return None
        try:
            os.utime(path)  # its last access, for the LRU of processes that scan it later
        except OSError:
            pass
        doomed: list[Path] = []
        with self._lock:
            self.stats.loads += 1
            self.stats.load_seconds += self._clock() - start
            if self._index.get(key) is None:   # another process's file: indexed now
                doomed = self._add(key, DiskEntry(path, packed, header.dense_tokens), path)
        for old in doomed:
            old.unlink(missing_ok=True)
        return snap

    def contains(self, tier: str, namespace: str, model_id: str, packed_ids: bytes) -> bool:
        """Whether the index holds exactly these ids (the caller need not write them again)."""
        with self._lock:
            entry = self._index.peek(self.key(tier, namespace, model_id, packed_ids))
            return entry is not None and entry.packed_ids == packed_ids

    # -- writes (the writer thread) ------------------------------------------------------------

    def submit(self, tier: str, namespace: str, model_id: str, prefix_ids: Sequence[int],
               snapshot: KVSnapshot, *, supersede: bool = False) -> bool:
        """Queue a snapshot for writing; False (counted) if the queue is full or the snapshot
        is larger than the whole tier. Never blocks."""
        if model_id not in self.fingerprints:   # a model this store was not told about
            return False
        if not isinstance(snapshot, KVSnapshot):
            # A layered snapshot (sliding-window or recurrent layers, layered.py) has no file
            # format yet: it stays in RAM, and a restart recomputes it.
            return False
        packed = pack_ids(prefix_ids)
        if snapshot.nbytes > self.max_bytes:
            with self._lock:
                self.stats.write_drops += 1
            return False
        if self.contains(tier, namespace, model_id, packed):
            return True
        with self._lock:
            generation = self._generation
        item = _Write(self.key(tier, namespace, model_id, packed), packed, snapshot, supersede,
                      generation)
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
        if self._purged_since(namespace, item.generation):
            return
        path = self.path(item.key)
        for folder in (path.parents[2], path.parents[1], path.parent):  # tier, namespace, h[:2]
            folder.mkdir(mode=0o700, exist_ok=True)
        arrays, meta = kv_file.encode(item.snapshot, tier=tier, namespace=namespace,
                                      model_id=model_id,
                                      fingerprint=self.fingerprints[model_id],
                                      packed_ids=item.packed_ids)
        kv_file.write(path, arrays, meta)
        entry = DiskEntry(path, item.packed_ids, item.snapshot.dense_tokens)
        with self._lock:
            if self._purged_since(namespace, item.generation):  # purged while it was written
                doomed = [path]
            else:
                self.stats.writes += 1
                doomed = self._add(item.key, entry, path)
                if item.supersede:
                    covered = self._index.pop_where(
                        lambda k, e: k[:3] == item.key[:3] and k != item.key
                        and item.packed_ids.startswith(e.packed_ids))
                    doomed += [e.path for _, e in covered]
        for old in doomed:
            old.unlink(missing_ok=True)

    def _add(self, key: DiskKey, entry: DiskEntry, path: Path) -> list[Path]:
        """Index a file as the most recently used; the paths evicted to stay within bounds
        (the caller deletes them, outside the lock). Call with the lock held."""
        try:
            size = path.stat().st_size
        except OSError:   # already evicted by another process
            return []
        evicted = self._index.put(key, entry, size)
        if evicted is None:   # larger than the whole tier
            return [path]
        self.stats.evictions += len(evicted)
        return [e.path for _, e in evicted]

    # -- the index -----------------------------------------------------------------------------

    def scan(self) -> int:
        """Rebuild the index from the folder's files, least recently used (oldest mtime) first;
        bad files and stale temporary ones are deleted. The number of files indexed."""
        found: list[tuple[float, DiskKey, DiskEntry, int]] = []
        now = time.time()
        for path in self.root.rglob(f"*{kv_file.SUFFIX}"):
            try:
                st = path.stat()
                if path.name.startswith("."):   # a temporary file: a writer's, or a crash's
                    if now - st.st_mtime > STALE_TMP_S:
                        path.unlink(missing_ok=True)
                    continue
                header = kv_file.check_header(kv_file.read_header(path), self.fingerprints)
            except FileNotFoundError:
                continue
            except (KVFileError, OSError) as exc:
                log.warning("KV file %s is bad (%s); deleted", path, exc)
                self._discard(path, None)
                continue
            key = self.key(header.tier, header.namespace, header.model_id, header.packed_ids)
            if self.path(key) != path:   # not where its metadata says: not ours to trust
                self._discard(path, None)
                continue
            found.append((st.st_mtime, key, DiskEntry(path, header.packed_ids,
                                                      header.dense_tokens), st.st_size))
        found.sort(key=lambda f: f[0])
        doomed: list[Path] = []
        with self._lock:
            self._index = ByteLRU(self.max_bytes)
            for _, key, entry, size in found:
                evicted = self._index.put(key, entry, size) or []
                self.stats.evictions += len(evicted)
                doomed += [e.path for _, e in evicted]
            count = len(self._index)
        for path in doomed:
            path.unlink(missing_ok=True)
        return count

    def _forget(self, key: DiskKey) -> None:
        with self._lock:
            self._index.pop(key)

    def _discard(self, path: Path, key: DiskKey | None) -> None:
        path.unlink(missing_ok=True)
        with self._lock:
            self.stats.discarded += 1
            if key is not None:
                self._index.pop(key)

    def _purged_since(self, namespace: str, generation: int) -> bool:
        return max(self._purged_at.get(namespace, -1), self._purged_at.get(None, -1)) >= generation

    # -- purges and figures --------------------------------------------------------------------

    def purge(self, tier: str | None = None, namespace: str | None = None) -> int:
        """Delete the files of a tier and a namespace (None: every one), this process's and
        others'; the number of indexed files deleted."""
        with self._lock:
            self._purged_at[namespace] = self._generation
            self._generation += 1
            doomed = self._index.pop_where(
                lambda k, _: (tier is None or k[0] == tier)
                and (namespace is None or k[1] == namespace))
        tiers = [tier] if tier is not None else [p.name for p in self.root.iterdir() if p.is_dir()]
        for t in tiers:
            folders = ([self.root / t / _namespace_dir(namespace)] if namespace is not None
                       else [self.root / t])
            for folder in folders:
                shutil.rmtree(folder, ignore_errors=True)
        for _, entry in doomed:
            entry.path.unlink(missing_ok=True)
        return len(doomed)

    @property
    def nbytes(self) -> int:
        return self._index.nbytes

    def __len__(self) -> int:
        return len(self._index)

    def snapshot_stats(self) -> DiskKVStats:
        """The tier's figures now."""
        with self._lock:
            return DiskKVStats(**counted(self.stats), entries=len(self._index),
                               bytes=self._index.nbytes, max_bytes=self.max_bytes,
                               queued=self._queue.qsize())


def kv_disk_folder(model_dir: str | Path, base: str | Path | None = None) -> Path:
    """The disk tier's folder of a model: ``<base>/<model folder name>-<hash of its path>``,
    ``base`` defaulting to ``engine-kv`` under the cache folder. One folder per model: the
    files of another model in it would be deleted as foreign."""
    from prefix_cache.demo import cache_home

    folder = Path(model_dir).resolve()
    root = Path(base) if base is not None else cache_home() / "engine-kv"
    return root / f"{folder.name}-{xxhash.xxh3_64_hexdigest(str(folder).encode())[:8]}"


def open_kv_disk(model_dir: str | Path, draft_dir: str | Path | None, base: str | Path | None,
                 max_bytes: int) -> DiskKVStore | None:
    """The disk tier of a model folder (and its draft), or None when ``max_bytes`` is 0."""
    if not max_bytes:
        log.info("KV disk tier of %s: off (kv_disk_bytes=0)", Path(model_dir).name)
        return None
    fingerprints = {"target": kv_file.folder_fingerprint(model_dir)}
    if draft_dir is not None:
        fingerprints["draft"] = kv_file.folder_fingerprint(draft_dir)
    disk = DiskKVStore(kv_disk_folder(model_dir, base), max_bytes, fingerprints)
    disk.owned = True
    log.info("KV disk tier of %s: %s, cap %.1f GiB (kv_disk_bytes; 0 turns it off), %d "
             "entries there now", Path(model_dir).name, disk.root, max_bytes / 2**30,
             len(disk))
    return disk
