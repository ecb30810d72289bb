"""What the engine benchmarks that fill a block of docs/engine.md share: the block (its two
markers), a parser that offers ``--update-docs``, and the end of a run (the table printed, and
written into the block when asked). Importing ``engine`` puts the repository on ``sys.path``."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from typing import Any

from engine import DOCS, ROOT, machine, update_docs

__all__ = ["DocBlock", "command", "machine", "whole_run"]


@dataclass(frozen=True)
class DocBlock:
    """The block ``<!-- bench:NAME:start -->`` ... ``<!-- bench:NAME:end -->`` of docs/engine.md."""

    name: str

    @property
    def start(self) -> str:
        return f"<!-- bench:{self.name}:start -->"

    @property
    def end(self) -> str:
        return f"<!-- bench:{self.name}:end -->"

    def parser(self, doc: str) -> argparse.ArgumentParser:
        """A parser described by the first line of ``doc``, with ``--update-docs``."""
        parser = argparse.ArgumentParser(description=doc.splitlines()[0])
        parser.add_argument("--update-docs", action="store_true",
                            help=f"write the table into {DOCS.relative_to(ROOT)}")
        return parser

    def publish(self, text: str, args: argparse.Namespace, raw: Any = None) -> int:
        """Print the run's table, write ``raw`` figures to ``--json`` (where the parser has it
        and they are given) and the table into the block under ``--update-docs``; exit 0."""
        print(text)
        if raw is not None and getattr(args, "json", None):
            args.json.write_text(json.dumps(raw, indent=2, default=str), encoding="utf-8")
        if args.update_docs:
            update_docs(text, self.start, self.end, DOCS)
        return 0


def whole_run(started: float) -> str:
    """The closing line of a table: how long the whole run took."""
    return f"Whole run: {time.perf_counter() - started:.0f} s."


def command(script: str, argv: list[str] | None) -> str:
    """The command line a table names: ``script`` with the arguments this run was given."""
    return script + "".join(f" {a}" for a in (argv or sys.argv[1:]))
