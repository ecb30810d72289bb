"""The model fingerprint a KV file is checked against: it changes whenever the weights do.

    fingerprint = xxh3_128(config.json, and per weight file (*.safetensors, sorted) its name,
                           size and the xxh3_128 of its whole content)

Every byte of every weight file is read, so an in-place change anywhere (a few rows of the
embedding edited, a fine-tune written over the folder, a partial copy) changes it. Reading a
large model costs seconds (docs/reliability.md has the figures), so each file's digest is
remembered in a memo file beside the KV (``fingerprints.json`` in the tier's folder, 0600),
keyed by the file's device, inode, size, mtime_ns and ctime_ns; a start re-reads only files
whose key changed. ctime is set by the kernel at every write, rename or chmod and cannot be set
back by a user, so a change the memo misses takes root changing the clock or a filesystem
without ctime. A change while the engine starts is caught too: the tier is opened (and the
weights fingerprinted) before mlx-lm loads them, and its first use after the load checks with
``weight_stats`` that no file was written since; if one was, the tier stays off for that
process. What it does not catch: a change while the engine runs (the loaded weights are in
memory; the next start sees it).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

import xxhash

CHUNK_BYTES = 16 << 20
MEMO_NAME = "fingerprints.json"


def file_digest(path: Path) -> str:
    """xxh3_128 of a file's whole content."""
    h = xxhash.xxh3_128()
    with open(path, "rb") as fh:
        while chunk := fh.read(CHUNK_BYTES):
            h.update(chunk)
    return h.hexdigest()


def _stat_key(st: os.stat_result) -> list[int]:
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def _read_memo(memo: Path | None) -> dict[str, dict[str, object]]:
    if memo is None:
        return {}
    try:
        data = json.loads(memo.read_text())
    except (OSError, ValueError):   # none yet, or unreadable: every file is hashed again
        return {}
    return data if isinstance(data, dict) else {}


def _write_memo(memo: Path, data: dict[str, dict[str, object]]) -> None:
    tmp = memo.with_name(f".{memo.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(data, fh)
    os.replace(tmp, memo)


def weight_files(folder: Path) -> Iterable[Path]:
    return sorted(folder.glob("*.safetensors"))


def weight_stats(folder: str | Path) -> list[list[int]]:
    """The memo's key of config.json and of every weight file: equal at two times only if
    none of them was written in between (ctime)."""
    root = Path(folder)
    files = [root / "config.json", *weight_files(root)]
    return [_stat_key(f.stat()) for f in files if f.is_file()]


def folder_fingerprint(folder: str | Path, memo: Path | None = None) -> str:
    """The fingerprint of a model folder (module docstring); digests remembered in ``memo``."""
    root = Path(folder)
    known = _read_memo(memo)
    h = xxhash.xxh3_128()
    config = root / "config.json"
    h.update(config.read_bytes() if config.is_file() else b"")
    changed = False
    for weights in weight_files(root):
        st = weights.stat()
        key, name = _stat_key(st), str(weights.resolve())
        entry = known.get(name)
        if not isinstance(entry, dict) or entry.get("stat") != key:
            entry = {"stat": key, "digest": file_digest(weights)}
            if _stat_key(weights.stat()) != key:   # written while it was read: not remembered
                memo = None
            known[name], changed = entry, True
        h.update(f"{weights.name}\0{st.st_size}\0{entry['digest']}\0".encode())
    if memo is not None and changed:
        try:
            _write_memo(memo, known)
        except OSError:   # a read-only folder: the next start hashes again
            pass
    return h.hexdigest()
