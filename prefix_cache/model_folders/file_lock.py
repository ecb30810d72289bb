"""One writer at a time across processes: an exclusive ``flock`` on a lock file, for the
folders made on first use (tokenizer folders, the demo chat model, its GGUF); and
``stamped_folder``, a folder made once per recipe (the converted model folders).

Correctness never depends on it (each writer renames its finished work into place); it saves
the duplicate work of a server and a test, or two workers, making the same folder at once.
Where ``flock`` is missing (Windows) the writers just race.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# What a made folder was made from (its recipe), written last: a folder whose stamp differs
# from the one asked for, or has none, is made again.
STAMP_FILE = ".prefix-cache-recipe.json"


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Hold the exclusive lock of ``path`` (created, with its folder, if missing)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not on the platforms this runs on
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def stamped_folder(folder: Path, stamp: dict[str, Any], make: Callable[[], None]) -> Path:
    """``folder``, made by ``make`` unless its stamp file already says ``stamp``; once across
    processes (the lock beside it; a writer that waited finds it made)."""

    def current() -> bool:
        try:
            return json.loads((folder / STAMP_FILE).read_text(encoding="utf-8")) == stamp
        except (OSError, ValueError):
            return False

    if current():
        return folder
    with file_lock(folder.with_name(f".{folder.name}.lock")):
        if not current():  # another process may have made it while we waited
            make()
            (folder / STAMP_FILE).write_text(json.dumps(stamp) + "\n", encoding="utf-8")
    return folder
