"""Where a model's KV disk tier lives, and opening it for an engine (with the fingerprints of
the model and its draft, ``kv_fingerprint``)."""

from __future__ import annotations

import logging
from pathlib import Path

import xxhash

from .disk import DiskKVStore
from .fingerprint import MEMO_NAME, folder_fingerprint, weight_stats
from .folder import check_root

log = logging.getLogger("engine_adapter.mlx_engine")


def kv_disk_folder(model_dir: str | Path, base: str | Path | None = None) -> Path:
    """The disk tier's folder of a model: ``<base>/<model folder name>-<hash of its path>``,
    ``base`` defaulting to ``engine-kv`` under the cache folder. One folder per model: the
    files of another model in it would be deleted as foreign."""
    from prefix_cache.model_folders.demo import cache_home

    folder = Path(model_dir).resolve()
    root = Path(base) if base is not None else cache_home() / "engine-kv"
    return root / f"{folder.name}-{xxhash.xxh3_64_hexdigest(str(folder).encode())[:8]}"


def open_kv_disk(model_dir: str | Path, draft_dir: str | Path | None, base: str | Path | None,
                 max_bytes: int) -> DiskKVStore | None:
    """The disk tier of a model folder (and its draft), or None when ``max_bytes`` is 0;
    ``KVFolderError`` (a ValueError) naming the reason when its folder is refused. Open it
    before loading the model: its first use checks that no weight file changed since it was
    fingerprinted (``kv_fingerprint``), so the KV it serves is the loaded weights'."""
    if not max_bytes:
        log.info("KV disk tier of %s: off (kv_disk_bytes=0)", Path(model_dir).name)
        return None
    if not Path(model_dir).is_dir() or (draft_dir is not None and not Path(draft_dir).is_dir()):
        # Not a local folder (missing, or a hub name mlx-lm resolves): no weights to
        # fingerprint here, so no KV to trust on disk; the load reports a missing folder.
        log.warning("KV disk tier off: %s is not a local model folder", model_dir)
        return None
    root = check_root(kv_disk_folder(model_dir, base))   # refused before any weight is read
    memo = root / MEMO_NAME
    folders = {"target": model_dir, **({"draft": draft_dir} if draft_dir is not None else {})}
    before = {name: weight_stats(folder) for name, folder in folders.items()}
    fingerprints = {name: folder_fingerprint(folder, memo) for name, folder in folders.items()}
    disk = DiskKVStore(root, max_bytes, fingerprints, weights_unchanged=lambda: before == {
        name: weight_stats(folder) for name, folder in folders.items()})
    disk.owned = True
    log.info("KV disk tier of %s: %s, cap %.1f GiB (kv_disk_bytes; 0 turns it off), %d "
             "entries there now", Path(model_dir).name, disk.root, max_bytes / 2**30, len(disk))
    return disk
