"""A tool list frozen once for many calls: its key material packed once, its value unchangeable.

``StaticPrefixCache.resolve`` must key the exact tools it is given, and a Python caller may change
its list between two calls, so by default every call packs the tools again: at 64 tools that is
about half of an in-process hit (``bench/hit_path.py``). An agent whose tool set is fixed for
its life freezes it once instead::

    tools = FrozenTools(tool_list)          # checked and packed here, once
    cache.resolve(tokenizer, messages, tools, prompt_ids=ids)   # every turn

The packed bytes are the truth: nothing outside holds the objects they were made from (the
list is copied by packing it), and reading a ``FrozenTools`` (iterating it, indexing it, a
render) unpacks a fresh copy, so no one can change what the key says the tools are. A hit
with prompt ids never reads them; a render pays one unpack (~10 us at 64 tools), less than
the pack it saves. Keys are byte-for-byte those of the same plain list.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, overload

import msgpack

from ..cache import keys
from ..errors import InvalidRequestError
from ._known_parts import KnownParts


class FrozenTools(Sequence[dict[str, Any]]):
    """An immutable tool list for ``resolve``/``aresolve``'s ``tools`` (``[]`` stays ``[]``)."""

    __slots__ = ("_len", "packed")

    def __init__(self, tools: Sequence[Mapping[str, Any]]) -> None:
        if isinstance(tools, FrozenTools):
            self.packed, self._len = tools.packed, tools._len
            return
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise InvalidRequestError("FrozenTools takes a list of tool objects (dicts)")
        self.packed = keys.packed_field(tools, "tools")
        self._len = len(tools)

    def unfrozen(self) -> list[dict[str, Any]]:
        """A fresh copy of the tools (exactly the values given: types, order, big integers)."""
        tools: list[dict[str, Any]] = msgpack.unpackb(self.packed, ext_hook=keys.unpack_ext,
                                                      strict_map_key=False)
        return tools

    def known(self, into: KnownParts | None = None) -> KnownParts:
        """``into`` (or a new one) knowing this list's key material."""
        out = into if into is not None else KnownParts()
        out.add_packed(self, self.packed, frozen=True)
        return out

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.unfrozen())

    @overload
    def __getitem__(self, index: int) -> dict[str, Any]: ...
    @overload
    def __getitem__(self, index: slice) -> list[dict[str, Any]]: ...
    def __getitem__(self, index: int | slice) -> dict[str, Any] | list[dict[str, Any]]:
        return self.unfrozen()[index]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FrozenTools) and other.packed == self.packed

    def __hash__(self) -> int:
        return hash(self.packed)

    def __repr__(self) -> str:
        return f"FrozenTools({self._len} tools, {len(self.packed)} bytes)"
