"""What a disk tier's folder holds: its KV files' headers (for the index built at start), bad
names to delete, and the temporary files of writers that died.

Only regular files are opened, without blocking, and no link is followed (``TierFolder``); a
FIFO, a device or a link named like a KV file is bad. A temporary file (``.<name>.<pid>.…``) is
a writer's while its process runs; once that process is gone (killed mid-write) or after
``STALE_TMP_S`` (its pid may have been reused), it is deleted.
"""

from __future__ import annotations

import logging
import os
import stat
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from . import file as kv_file
from .file import KVFileError, KVFileHeader
from .folder import TierFolder, pid_alive, temp_writer_pid

log = logging.getLogger("engine_adapter.mlx_engine")

STALE_TMP_S = 3600.0   # a temporary file this old is a crashed writer's, whatever its pid


@dataclass(frozen=True, slots=True)
class FoundFile:
    """A KV file whose header checks out."""

    rel: str
    header: KVFileHeader
    mtime: float
    size: int


@dataclass(slots=True)
class FolderScan:
    """The folder's KV files, and how many bad and dead temporary files were deleted."""

    found: list[FoundFile] = field(default_factory=list)
    bad: int = 0
    temp_removed: int = 0


def _is_dead_temp(name: str, st: os.stat_result, now: float) -> bool:
    pid = temp_writer_pid(name)
    return pid is None or not pid_alive(pid) or now - st.st_mtime > STALE_TMP_S


def remove_dead_temps(folder: TierFolder) -> int:
    """Delete the temporary files of writers that are gone; how many."""
    removed = 0
    now = time.time()
    for rel, st in folder.files(kv_file.SUFFIX):
        name = os.path.basename(rel)
        if name.startswith(".") and _is_dead_temp(name, st, now):
            folder.unlink(rel)
            removed += 1
    return removed


def scan_folder(folder: TierFolder, fingerprints: Mapping[str, str]) -> FolderScan:
    """Read every KV file's header; delete what is bad and the dead writers' temporary files."""
    scan = FolderScan()
    now = time.time()
    for rel, st in folder.files(kv_file.SUFFIX):
        name = os.path.basename(rel)
        if name.startswith("."):
            if _is_dead_temp(name, st, now):
                folder.unlink(rel)
                scan.temp_removed += 1
            continue
        try:
            if not stat.S_ISREG(st.st_mode):
                raise KVFileError("not a regular file")
            with folder.open(rel) as fh:
                header = kv_file.check_header(kv_file.read_header(fh), fingerprints)
        except FileNotFoundError:
            continue
        except (KVFileError, OSError) as exc:
            log.warning("KV file %s is bad (%s); deleted", folder.path / rel, exc)
            folder.unlink(rel)
            scan.bad += 1
            continue
        scan.found.append(FoundFile(rel, header, st.st_mtime, st.st_size))
    if scan.temp_removed:
        log.info("KV disk %s: %d temporary files of dead writers deleted", folder.path,
                 scan.temp_removed)
    scan.found.sort(key=lambda f: f.mtime)
    return scan
