"""A JSON request body parsed part by part, the exact bytes of its large parts remembered.

An agent sends the same tools and system prompt on every turn, byte for byte. The body is split
into its top-level fields (and ``messages`` into its messages) by msgspec, which only finds
where each value starts and ends; every part is then parsed by ``json_io`` as the whole body
would have been, so orjson's rules still decide what is valid JSON. A large part (a tool list,
a message) whose exact bytes this scope (the caller's tenant) sent before is parsed without the
checks those bytes already passed (nesting, long integers) and comes with its key material
already packed (``KnownParts``): the key of a hit is then an xxh3 over bytes already at hand.
Its value is parsed afresh, unless the caller reads the body without changing any of it and
asks to ``share`` parts: then the value parsed the first time is handed out again (the
sidecar's boundary route: the body goes only to the cache, whose renders cannot change it).

A sharing caller also gets ``prompt_ids`` as ``TokenIds`` (checked and packed) when they are
token ids. A client sends back the ids it was given plus a new tail, so the text of the ids its
scope last sent starting the same way is kept: the part of the new text equal to it is taken as
its packed ids (no integers made), and only the rest is parsed.

Whatever the split cannot vouch for -- whitespace or duplicate keys it cannot account for, a
key with escapes, a part that does not parse -- goes to ``json_io.loads`` of the whole body,
which answers exactly as before (the same value, or the same error).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import orjson
import xxhash

from ..util import json_io
from ..util.prefix_len import common_prefix_len
from ..cache.keys import packed_part
from ..util.lru import ByteLRU
from ..util.token_ids import TokenIds, pack_ids
from ._known_parts import KnownParts

REMEMBERED_BYTES = 1024   # parts at least this long are remembered
MEMO_BYTES = 32 << 20     # all remembered parts' bytes, per worker
IDS_MEMO_BYTES = 16 << 20  # all remembered token ids' texts and packed ids, per worker
# A scope's agents are told apart by their ids' first bytes (the start of their static part):
# each one's last ids text is kept.
IDS_HEAD = 512
_ENTRY_OVERHEAD = 200     # the memo's own bytes per entry (key, tuple, OrderedDict node)
_VALUE_BYTES = 6          # a parsed value's Python objects per byte of its JSON (~4 measured)

_NOT_KEPT: Any = object()  # a Remembered without its value

_OBJECT = msgspec.json.Decoder(dict[str, msgspec.Raw])
_ARRAY = msgspec.json.Decoder(list[msgspec.Raw])
_WHITESPACE = b" \t\n\r"
# Keys counted by their decoded length must be written without escapes or whitespace.
_PLAIN_KEY = re.compile(r"[\x21\x23-\x5b\x5d-\x7e]+")


@dataclass(frozen=True, slots=True)
class Remembered:
    """A part's exact bytes, its packed key material, and its value when it is shared."""

    part: bytes
    packed: bytes
    value: Any = _NOT_KEPT


class PartMemo:
    """Exact bytes of large parts -> what they parsed to, per scope and nesting allowed (the
    same bytes deeper in a body may nest less); LRU in bytes."""

    def __init__(self, max_bytes: int = MEMO_BYTES,
                 max_ids_bytes: int = IDS_MEMO_BYTES) -> None:
        self._lru: ByteLRU[tuple[str, int, int], Remembered] = ByteLRU(max_bytes)
        self._ids: ByteLRU[tuple[str, int], Remembered] = ByteLRU(max_ids_bytes)
        self._lock = threading.Lock()

    def get(self, scope: str, depth: int, part: bytes) -> Remembered | None:
        key = (scope, depth, xxhash.xxh3_64_intdigest(part))
        with self._lock:
            found = self._lru.get(key)
        return found if found is not None and found.part == part else None

    def put(self, scope: str, depth: int, found: Remembered) -> None:
        key = (scope, depth, xxhash.xxh3_64_intdigest(found.part))
        size = len(found.part) + len(found.packed) + _ENTRY_OVERHEAD
        if found.value is not _NOT_KEPT:
            size += _VALUE_BYTES * len(found.part)
        with self._lock:
            self._lru.put(key, found, size)

    def get_ids(self, scope: str, text: bytes) -> Remembered | None:
        """The last token ids text ``scope`` sent that starts as ``text`` does (its first
        ``IDS_HEAD`` bytes), and their packed form."""
        with self._lock:
            return self._ids.get((scope, xxhash.xxh3_64_intdigest(text[:IDS_HEAD])))

    def put_ids(self, scope: str, text: bytes, packed: bytes) -> None:
        key = (scope, xxhash.xxh3_64_intdigest(text[:IDS_HEAD]))
        with self._lock:
            self._ids.put(key, Remembered(text, packed), len(text) + len(packed) + _ENTRY_OVERHEAD)

    def __len__(self) -> int:
        return len(self._lru)

    @property
    def nbytes(self) -> int:
        """The bytes the remembered parts are counted at (at most ``max_bytes``)."""
        return self._lru.nbytes

    @property
    def ids_nbytes(self) -> int:
        """The bytes the remembered token ids texts are counted at (at most ``max_ids_bytes``)."""
        return self._ids.nbytes

    def remembered(self) -> list[Remembered]:
        """The remembered parts, most recently used last (a read-only snapshot)."""
        with self._lock:
            return [found for _, found in self._lru.items()]

    def remembered_ids(self) -> list[Remembered]:
        """The remembered token ids texts, one per scope and start (a read-only snapshot)."""
        with self._lock:
            return [found for _, found in self._ids.items()]


def parse_body(raw: bytes, memo: PartMemo | None = None, scope: str = "",
               share: bool = False) -> tuple[Any, KnownParts]:
    """``json_io.loads(raw)`` (the same value, or the same JSONInputError), and what is known of
    its parts: with ``memo``, the key material of large parts. ``share``: large parts may be
    values other requests of ``scope`` also hold (read-only), ``prompt_ids`` that are token
    ids come as ``TokenIds``, and the messages are known to be JSON data (``add_json``)."""
    known = KnownParts()
    data: Any = None
    if memo is not None and len(raw) >= REMEMBERED_BYTES and raw[:1] == b"{":
        try:
            data = _Parts(memo, scope, known, share).body(raw)
        except _Unsplit:
            known = KnownParts()
    if data is None:
        data = json_io.loads(raw)
    if share and type(data) is dict and type(messages := data.get("messages")) is list:
        known.add_json(messages)  # read-only from here on: a render need not copy them
    return data, known


class _Unsplit(Exception):
    """The split cannot vouch for this body: parse it whole."""


class _Parts:
    """One body's parse, part by part."""

    def __init__(self, memo: PartMemo, scope: str, known: KnownParts, share: bool) -> None:
        self.memo, self.scope, self.known, self.share = memo, scope, known, share

    def body(self, raw: bytes) -> dict[str, Any]:
        fields = _split(_OBJECT, raw)
        if not all(_PLAIN_KEY.fullmatch(name) for name in fields):
            raise _Unsplit
        # One value per key, and nothing else: outside the values, the body is the braces, the
        # keys, colons and commas (a duplicate key's dropped value, or an escape in a key,
        # would be left over).
        spans = _spans(raw, fields.values())
        expected = "{" + ",".join(f'"{name}":' for name in fields) + "}"
        if _between(raw, spans) != expected.encode():
            raise _Unsplit
        return {name: self.field(name, raw[start:end])
                for name, (start, end) in zip(fields, spans, strict=True)}

    def field(self, name: str, span: bytes) -> Any:
        if name == "messages" and span[:1] == b"[":
            return self.messages(span)
        if name == "prompt_ids" and self.share and span[:1] == b"[":
            return self.token_ids(span)
        return self.value(span, json_io.MAX_DEPTH - 1)

    def messages(self, span: bytes) -> list[Any]:
        """The messages, each one of 1 KB or more parsed (and remembered) alone, the runs of
        smaller ones between them each in one parse: a long conversation's turns one by one
        cost a lookup of each one's place and a parse call each."""
        items = _split(_ARRAY, span)
        base: int | None = None  # span's address, once a large item needs its place
        out: list[Any] = []
        done, after = 0, 1  # items parsed so far; where the next run starts (after "[")
        for i, item in enumerate(items):
            if len(item) < REMEMBERED_BYTES:
                continue
            base = _address(span) if base is None else base
            start = _address(item) - base
            if not after <= start < len(span):
                raise _Unsplit  # not a view into span after all
            out += self.run(span[after:start], i - done, lead=done > 0, trail=True)
            out.append(self.value(span[start:start + len(item)], json_io.MAX_DEPTH - 2))
            done, after = i + 1, start + len(item)
        out += self.run(span[after:len(span) - 1], len(items) - done, lead=done > 0,
                        trail=False)
        return out

    @staticmethod
    def run(between: bytes, count: int, lead: bool, trail: bool) -> list[Any]:
        """The ``count`` items in ``between``: the bytes between two parsed items (``lead``,
        ``trail``: there is one before, after) or the array's brackets. Each comma there stands
        between two items, so there is one after the item before when anything follows it, and
        one before the item after when this run has items."""
        inner = between.strip(_WHITESPACE)
        if lead and (count or trail):
            if inner[:1] != b",":
                raise _Unsplit
            inner = inner[1:]
        if trail and count:
            if inner[-1:] != b",":
                raise _Unsplit
            inner = inner[:-1]
        if count == 0:
            if inner.strip(_WHITESPACE):
                raise _Unsplit
            return []
        try:
            value = json_io.loads(b"[" + inner + b"]", json_io.MAX_DEPTH - 1)
        except json_io.JSONInputError:
            raise _Unsplit from None
        if type(value) is not list or len(value) != count:
            raise _Unsplit
        return value

    def token_ids(self, span: bytes) -> Any:
        """``TokenIds`` when ``span`` is a list of token ids (checked by packing them, as the
        cache would); anything else is parsed as any other value (the cache refuses it).
        ``true``/``false`` would pack as 1 and 0: a list holding either (the only letters a
        list of JSON integers cannot hold) is parsed as it is, for the route to refuse."""
        if b"t" in span or b"f" in span:
            return self.value(span, json_io.MAX_DEPTH - 1)
        last = self.memo.get_ids(self.scope, span)
        ids = _after(last, span) if last is not None else None
        if ids is None:
            try:
                value = orjson.loads(span)
                ids = TokenIds(value, pack_ids(value)) if type(value) is list else None
            except (orjson.JSONDecodeError, OverflowError, TypeError, ValueError):
                ids = None
        if ids is None:
            return self.value(span, json_io.MAX_DEPTH - 1)
        self.memo.put_ids(self.scope, span, ids.packed)
        return ids

    def value(self, span: bytes, max_depth: int) -> Any:
        """``span`` parsed as ``json_io.loads`` parses it, at ``max_depth`` levels left."""
        large = len(span) >= REMEMBERED_BYTES
        if large and (found := self.memo.get(self.scope, max_depth, span)) is not None:
            if self.share and found.value is not _NOT_KEPT:
                value = found.value
            else:
                # These bytes parsed before within the depth limit, and packed as they are:
                # no integer orjson cannot keep, so orjson alone gives their exact value again.
                value = orjson.loads(span)
                if self.share:
                    self.memo.put(self.scope, max_depth, Remembered(span, found.packed, value))
            self.known.add_packed(value, found.packed)
            return value
        try:
            value = json_io.loads(span, max_depth)
        except json_io.JSONInputError:
            raise _Unsplit from None  # the whole body's parse words the error
        if large and (packed := packed_part(value)) is not None:
            kept = value if self.share else _NOT_KEPT
            self.memo.put(self.scope, max_depth, Remembered(span, packed, kept))
            self.known.add_packed(value, packed)
        return value


def _after(last: Remembered, text: bytes) -> TokenIds | None:
    """The token ids of ``text`` (a list's JSON) when it starts as ``last.part`` did, the ids
    ``last.packed``: up to the last comma both have in common, the ids are the same (a JSON list
    of integers has no other commas); the rest is parsed. None when there is no such start or
    the rest is not token ids (then ``text`` is parsed whole)."""
    cut = text.rfind(b",", 0, common_prefix_len(text, last.part))
    if cut < 0:
        return None
    known = text.count(b",", 0, cut)  # the ids before the cut: one comma after each
    try:
        rest = orjson.loads(b"[" + text[cut + 1:])
        if type(rest) is not list or not rest:  # "[1,]" is not JSON
            return None
        packed = last.packed[:4 * known + 4] + pack_ids(rest)
    except (orjson.JSONDecodeError, OverflowError, TypeError, ValueError):
        return None
    return TokenIds(None, packed)


def _split(decoder: msgspec.json.Decoder, raw: bytes) -> Any:
    try:
        return decoder.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        raise _Unsplit from None


def _spans(raw: bytes, parts: Iterable[msgspec.Raw]) -> list[tuple[int, int]]:
    """Where each part (a view into ``raw``) starts and ends in it, in order."""
    base = _address(raw)
    spans = sorted((start, start + len(part)) for part in parts
                   for start in (_address(part) - base,))
    edges = _edges(raw, spans)
    if any(edges[i] > edges[i + 1] for i in range(len(edges) - 1)):
        raise _Unsplit  # not views into raw after all, or overlapping
    return spans


def _edges(raw: bytes, spans: list[tuple[int, int]]) -> list[int]:
    """0, each span's start and end, len(raw): the gaps are edges[0:2], edges[2:4], ..."""
    return [0, *(edge for span in spans for edge in span), len(raw)]


def _address(buffer: Any) -> int:
    return int(np.frombuffer(buffer, np.uint8).ctypes.data)


def _between(raw: bytes, spans: list[tuple[int, int]]) -> bytes:
    """The bytes of ``raw`` outside ``spans``, JSON whitespace left out."""
    edges = _edges(raw, spans)
    gaps = b"".join(raw[edges[i]:edges[i + 1]] for i in range(0, len(edges), 2))
    return gaps.translate(None, _WHITESPACE)
