"""The stored value: a compact, self-checking binary record of one static prefix.

Layout (little-endian)::

    magic "SPCE" | version u8 | flags u8 | key_len u16 | check u64 | render_us u32 | n_ids u32
    cap u32 | key bytes | n_ids * u32 token ids
    [split: anchor u32 | index u32 | text_len u32 | text (UTF-8)]     (flags bit 1)
    | xxh3-64 digest of all the bytes before it

``flags`` bit 0: the probes rendered with ``tools=[]`` (the documented fallback for a request
without tools whose template fails on ``None``), so the prompt is rendered the same way. Bit 1:
the entry holds a safe split of the static text (``split.StaticSplit``): a prompt whose text
starts with it is tokenized from the anchor on only. ``cap``: where a multi-turn probe puts its
first user text (see ``boundary.text_start_cap``). Version 2 entries (no split section) are
still read, as entries without a split.

The key inside the value catches a foreign entry (a bug or a hand edit put it under another key),
the check value catches a true collision of the key hash, the digest catches corruption and
truncation, and the version lets a new layout be rolled out without misreading the old one.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from ..errors import EntryError
from ..render.split import StaticSplit
from ..util.lru import ByteLRU
from ..util.token_ids import pack_ids, unpack_ids

__all__ = ["MAGIC", "VERSION", "DecodedEntries", "Entry", "decode_entry", "encode_entry",
           "pack_ids"]

MAGIC = b"SPCE"
VERSION = 3
_READABLE = (2, 3)
_HEADER = struct.Struct("<4sBBHQIII")
_SPLIT = struct.Struct("<III")
_DIGEST = struct.Struct("<Q")
_MAX_U32 = 0xFFFF_FFFF
_EMPTY_TOOLS = 0x01
_HAS_SPLIT = 0x02
DECODED_BYTES = 32 << 20   # remembered decoded entries, per cache (per worker)


@dataclass(frozen=True, slots=True)
class Entry:
    """A decoded entry: the static scaffold's token ids (packed), how the probes rendered, and
    what they cost.

    The ids stay packed: on a hit, comparing the prompt's packed prefix with them is a memcmp,
    several times cheaper than building a list of Python ints and comparing element by element.
    """

    key: str
    check: int
    packed_ids: bytes
    render_seconds: float
    cap: int = _MAX_U32          # multi-turn first-text position (no cap by default)
    empty_tools: bool = False    # the probes rendered with tools=[] (the fallback)
    split: StaticSplit | None = None  # where a prompt's text may be cut for tokenization

    @property
    def n_static(self) -> int:
        return len(self.packed_ids) // 4

    @property
    def static_ids(self) -> list[int]:
        return unpack_ids(self.packed_ids)


def encode_entry(key: str, check: int, static_ids: Sequence[int] | bytes, render_seconds: float,
                 *, cap: int = _MAX_U32, empty_tools: bool = False,
                 split: StaticSplit | None = None) -> bytes:
    """Serialize one entry; token ids (a sequence, or already packed) must fit in uint32."""
    key_bytes = key.encode()
    ids = static_ids if isinstance(static_ids, bytes) else pack_ids(static_ids)
    render_us = min(max(int(render_seconds * 1e6), 0), _MAX_U32)
    flags = (_EMPTY_TOOLS if empty_tools else 0) | (_HAS_SPLIT if split is not None else 0)
    parts = [
        _HEADER.pack(MAGIC, VERSION, flags, len(key_bytes), check, render_us, len(ids) // 4,
                     min(max(cap, 0), _MAX_U32)),
        key_bytes,
        ids,
    ]
    if split is not None:
        text = split.text.encode()
        parts += [_SPLIT.pack(split.anchor, split.index, len(text)), text]
    body = b"".join(parts)
    return body + _DIGEST.pack(xxhash.xxh3_64_intdigest(body))


def decode_entry(data: bytes, key: str, check: int) -> Entry:
    """Parse and verify an entry read under ``key``; raise EntryError if it is not ours."""
    if len(data) < _HEADER.size + _DIGEST.size:
        raise EntryError("entry truncated")
    magic, version, flags, key_len, stored_check, render_us, n_ids, cap = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise EntryError("not a static-prefix entry")
    if version not in _READABLE:
        raise EntryError(f"entry format version {version}, expected {VERSION}")
    ids_end = _HEADER.size + key_len + 4 * n_ids
    body_len = len(data) - _DIGEST.size
    if body_len < ids_end:
        raise EntryError("entry length does not match its header")
    (digest,) = _DIGEST.unpack_from(data, body_len)
    if digest != xxhash.xxh3_64_intdigest(memoryview(data)[:body_len]):
        raise EntryError("entry digest mismatch (corrupted)")
    stored_key = bytes(data[_HEADER.size : _HEADER.size + key_len]).decode(errors="replace")
    if stored_key != key:
        raise EntryError("entry belongs to another key")
    if stored_check != check:
        raise EntryError("entry check value mismatch (key collision)")
    split = _decode_split(data, ids_end, body_len, n_ids) if flags & _HAS_SPLIT else None
    if split is None and body_len != ids_end:
        raise EntryError("entry length does not match its header")
    return Entry(key, stored_check, bytes(data[_HEADER.size + key_len : ids_end]), render_us / 1e6,
                 cap, bool(flags & _EMPTY_TOOLS), split)


def _decode_split(data: bytes, start: int, body_len: int, n_ids: int) -> StaticSplit:
    if body_len < start + _SPLIT.size:
        raise EntryError("entry split section truncated")
    anchor, index, text_len = _SPLIT.unpack_from(data, start)
    if start + _SPLIT.size + text_len != body_len:
        raise EntryError("entry length does not match its header")
    try:
        text = bytes(data[start + _SPLIT.size : body_len]).decode()
    except UnicodeDecodeError:
        raise EntryError("entry split text is not UTF-8") from None
    if not (anchor < len(text) and index < n_ids):
        raise EntryError("entry split out of range")
    return StaticSplit(text, anchor, index)


class DecodedEntries:
    """``decode_entry`` remembering its last answer per key: a hit reads the same stored value
    again and again, and decoding it (the digest over ~30 KB, copies of the ids and the split
    text) was ~9 us of a hit. A remembered entry is given back only for the very bytes it was
    decoded from (the same object, or equal bytes: a Redis read is a new object each time)
    under the same key and check value; LRU, bounded in bytes."""

    def __init__(self, max_bytes: int = DECODED_BYTES) -> None:
        self._lru: ByteLRU[str, tuple[bytes, int, Entry]] = ByteLRU(max_bytes)
        self._lock = threading.Lock()

    def decode(self, data: bytes, key: str, check: int) -> Entry:
        """``decode_entry(data, key, check)``."""
        with self._lock:
            known = self._lru.get(key)
        if known is not None and known[1] == check and (known[0] is data or known[0] == data):
            return known[2]
        entry = decode_entry(data, key, check)
        size = 2 * len(data) + (0 if entry.split is None else len(entry.split.text))
        with self._lock:
            self._lru.put(key, (bytes(data), check, entry), size)
        return entry
