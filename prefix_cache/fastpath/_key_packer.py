"""The key's field bytes packed in C: the accelerated ``keys.KeyPacker``.

``msgpack`` with ``strict_types`` checks the types and packs in one C pass; only data it cannot
take (integers beyond 64 bits, a lone surrogate, a type to refuse) goes through the plain walk.
The one refused kind it does take -- binary and extension values -- is found in its output
(``keys.packed_part``). Parts a request's hints know (a body's parse, a frozen tool list) are
put in as they are: a msgpack array is its header, then each element's own packing.

What it does not check is nesting: msgpack packs 1024 levels, the plain walk refuses past
``keys.MAX_DEPTH`` (a render walks the value recursively). So every packing this packer has not
made before is walked once the plain way, which refuses what it refuses with its own error, and
its digest is remembered: the bytes fix the value's structure, so equal bytes nest alike. A hit
pays one hash and one set lookup; a deep value is refused on both paths, at the same depth,
with the same error.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

import xxhash

from ..cache import keys
from ..cache.keys import KEY_FIELDS, KeyPacker, packed_array, packed_part
from ..util.hints import Hints
from ._frozen_tools import FrozenTools
from ._known_parts import KnownParts

MAX_SEEN = 1 << 16   # digests of packings walked once (16 bytes each, per cache)
_NIL = packed_part(None)


class FastKeyPacker(KeyPacker):
    """``KeyPacker``'s bytes and refusals, packed in C; the plain walk once per new packing."""

    def __init__(self, plain: KeyPacker | None = None, max_seen: int = MAX_SEEN) -> None:
        self.plain = plain or KeyPacker()
        self._seen: dict[bytes, None] = {}
        self._max_seen = max_seen
        self._lock = threading.Lock()

    def fields(self, static: Sequence[Mapping[str, Any]],
               tools: Sequence[Mapping[str, Any]] | None,
               kwargs: Mapping[str, Any] | None) -> bytes:
        return self.hinted_fields(static, tools, kwargs, None)

    def request(self, tools: Any, hints: Hints | None) -> tuple[Any, KeyPacker]:
        """``tools`` as they are (a ``FrozenTools`` stays frozen: its packing is known), and
        this packer with what the request's ``hints`` (and a frozen tool list) already packed
        put in as it is."""
        hints = _with_frozen(tools, hints)
        return tools, (_Hinted(self, hints) if hints else self)

    def hinted_fields(self, static: Sequence[Mapping[str, Any]],
                      tools: Sequence[Mapping[str, Any]] | None,
                      kwargs: Mapping[str, Any] | None, hints: Hints | None) -> bytes:
        given = (static, tools, kwargs or None)
        packed = _with_hints(given, hints) if hints else packed_part(keys.values(given))
        if packed is None:  # not plain data as it is: the walk decides and names what it refuses
            return self.plain.fields(static, tools, kwargs)
        digest = xxhash.xxh3_128_digest(packed)
        if digest not in self._seen:
            self.plain.fields(static, tools, kwargs)  # refuses what the plain path refuses
            self._remember(digest)
        return packed

    def _remember(self, digest: bytes) -> None:
        with self._lock:
            if len(self._seen) >= self._max_seen:
                del self._seen[next(iter(self._seen))]
            self._seen[digest] = None

    def remembered(self) -> int:
        """How many packings were walked and remembered (read-only, for tests)."""
        return len(self._seen)


class _Hinted(KeyPacker):
    """A ``FastKeyPacker`` for one request, its hints bound."""

    def __init__(self, packer: FastKeyPacker, hints: Hints) -> None:
        self._packer, self._hints = packer, hints

    def fields(self, static: Sequence[Mapping[str, Any]],
               tools: Sequence[Mapping[str, Any]] | None,
               kwargs: Mapping[str, Any] | None) -> bytes:
        return self._packer.hinted_fields(static, tools, kwargs, self._hints)

    def frozen(self, tools: Any) -> bool:
        return self._hints.frozen(tools)

    def all_json(self, messages: Sequence[Any]) -> bool:
        return self._hints.all_json(messages)


def _with_frozen(tools: Any, hints: Hints | None) -> Hints | None:
    """``hints`` knowing ``tools``' packing too when they are a ``FrozenTools``."""
    if not isinstance(tools, FrozenTools):
        return hints
    return tools.known(hints if isinstance(hints, KnownParts) else None)


def _with_hints(given: tuple[Any, ...], hints: Hints) -> bytes | None:
    """The fields packed in C, the parts ``hints`` know put in as they are; None when a part
    is not plain data as it is (the plain walk then decides, and names what it refuses)."""
    parts = []
    for value, field in zip(given, KEY_FIELDS, strict=True):
        if value is None:
            part: bytes | None = _NIL
        elif field.by_item:
            items = [hints.packed(item) or packed_part(item) for item in value]
            part = None if None in items else packed_array(items)  # type: ignore[arg-type]
        else:
            part = hints.packed(value) or packed_part(field.shape(value))
        if part is None:
            return None
        parts.append(part)
    return packed_array(parts)
