"""A request's hints (``prefix_cache.util.hints.Hints``): what its body parser already worked out for
some of the objects it made -- the key material of a large part (a tool list, a message) whose
exact bytes were seen before, the messages being parser-made JSON -- and a frozen tool list's
packing.

Entries are found by object identity and hold the object itself, so an id cannot be reused
while the entry lives (a lookup also checks ``is``). They are valid for the objects exactly as
parsed: the parser makes them, the cache reads them in the same request, and nothing in between
changes a body's values (templates render in an immutable sandbox). Anything not found here is
computed the ordinary way, so an empty ``KnownParts`` changes nothing but speed.
"""

from __future__ import annotations

from typing import Any


class KnownParts:
    """Packed key material, per object parsed in one request (a ``Hints``)."""

    __slots__ = ("_json", "_packed")

    def __init__(self) -> None:
        self._packed: dict[int, tuple[Any, bytes, bool]] = {}
        self._json: dict[int, Any] = {}

    def __bool__(self) -> bool:
        return bool(self._packed)

    def add_packed(self, value: Any, packed: bytes, frozen: bool = False) -> None:
        """``packed``: ``value`` as ``keys.canonical_bytes`` packs one of its parts;
        ``frozen``: ``value`` is a ``FrozenTools`` (checked when it was frozen)."""
        self._packed[id(value)] = (value, packed, frozen)

    def packed(self, value: Any) -> bytes | None:
        found = self._packed.get(id(value))
        return found[1] if found is not None and found[0] is value else None

    def frozen(self, tools: Any) -> bool:
        found = self._packed.get(id(tools))
        return found is not None and found[0] is tools and found[2]

    def add_json(self, values: Any) -> None:
        """Each of ``values`` is JSON data its parser made and no one changes (a shared
        body's messages): dicts, lists, str, int, float, bool and None, nothing else."""
        for value in values:
            self._json[id(value)] = value

    def all_json(self, values: Any) -> bool:
        """Whether every one of ``values`` was added by ``add_json`` (the very objects)."""
        found = self._json
        return bool(found) and all(found.get(id(v)) is v for v in values)
