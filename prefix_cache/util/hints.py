"""What a request's body parse tells the accelerators (``prefix_cache.fastpath``): ``Hints``.

``Hints`` is what a request's body parse (or a frozen tool list) already worked out for some of
the objects the request holds -- their key material packed, parser-made JSON. One value per
request; it crosses from the body parser to the cache in ``PrefixRequest.hints``, and only the
accelerated key packer reads it (the plain one ignores it).

It is declared here, in the core, because the body parser and the cache both name it and the
accelerators are built on the core's key and token modules (``fastpath`` imports ``keys``).
Nothing a hint says may change an answer, only its cost: anything unknown is computed the
plain way.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol


class Hints(Protocol):
    """What one request's parse already knows of the objects it made, found by identity."""

    def __bool__(self) -> bool:
        """Whether any part's key material is known."""

    def packed(self, value: Any) -> bytes | None:
        """``value``'s key material as ``keys.canonical_bytes`` packs that part, when known."""

    def all_json(self, values: Iterable[Any]) -> bool:
        """Whether every one of ``values`` is JSON data a parser made and nothing changed."""

    def frozen(self, tools: Any) -> bool:
        """Whether ``tools`` is a tool list checked and packed when it was frozen (each read
        of it is a fresh copy)."""
