"""What the commands that write a model folder share (``gguf.convert``, ``testing.tiny_model``,
``demo_model``, ``gemma_model``): their parser's common part, and their end: the folder's path printed (exit 0), or what was
wrong with the input (exit 2)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path


def folder_parser(module: str, doc: str, template_default: str) -> argparse.ArgumentParser:
    """A parser for ``python -m <module>``, described by the first line of ``doc``, with
    ``--chat-template FILE`` (``template_default``: what is used without it)."""
    parser = argparse.ArgumentParser(prog=f"python -m {module}", description=doc.splitlines()[0])
    parser.add_argument("--chat-template", type=Path, metavar="FILE",
                        help=f"chat template (default: {template_default})")
    return parser


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


def converted_model_main(module: str, doc: str, make: Callable[[int | None], Path],
                         argv: list[str] | None = None) -> int:
    """``python -m <module> [--layers N]`` for a model converted on demand (the demo chat model,
    Gemma 3 270M): the folder ``make(layers)`` returns, printed."""
    parser = argparse.ArgumentParser(prog=f"python -m {module}", description=doc.splitlines()[0])
    parser.add_argument("--layers", type=int, help="only the first N layers (a draft)")
    args = parser.parse_args(argv)
    return print_folder(module.rpartition(".")[2], lambda: make(args.layers), errors=(ValueError,))
