"""The end of a command that writes a model folder (``gguf.convert``, ``testing.tiny_model``):
the folder's path printed (exit 0), or what was wrong with the input (exit 2)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path


def read_template(path: Path | None) -> str | None:
    """A ``--chat-template FILE``'s text, or None when none was given."""
    return path.read_text("utf-8") if path else None


def print_folder(prog: str, make: Callable[[], Path],
                 errors: tuple[type[Exception], ...] = (ValueError, OSError)) -> int:
    """Run ``make``; print the folder it wrote, or ``prog: <error>`` for one of ``errors``."""
    try:
        folder = make()
    except errors as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    print(folder)
    return 0
