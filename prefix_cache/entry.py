"""The stored value: a compact, self-checking binary record of one static prefix.

Layout (little-endian)::

    magic "SPCE" | version u8 | pad u8 | key_len u16 | check u64 | render_us u32 | n_ids u32
    key bytes | n_ids * u32 token ids | xxh3-64 digest of all the bytes before it

The key inside the value catches a foreign entry (a bug or a hand edit put it under another key),
the check value catches a true collision of the key hash, the digest catches corruption and
truncation, and the version lets a new layout be rolled out without misreading the old one.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from .errors import EntryError

MAGIC = b"SPCE"
VERSION = 1
_HEADER = struct.Struct("<4sBxHQII")
_DIGEST = struct.Struct("<Q")
_U32 = next(code for code in "IL" if array(code).itemsize == 4)
_SWAP = sys.byteorder == "big"
_MAX_RENDER_US = 0xFFFF_FFFF


def pack_ids(ids: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32 bytes; OverflowError if one does not fit."""
    packed = array(_U32, ids)
    if _SWAP:
        packed.byteswap()
    return packed.tobytes()


@dataclass(frozen=True, slots=True)
class Entry:
    """A decoded entry: the static scaffold's token ids (packed) and what it cost to compute.

    The ids stay packed: on a hit, comparing the prompt's packed prefix with them is a memcmp,
    several times cheaper than building a list of Python ints and comparing element by element.
    """

    key: str
    check: int
    packed_ids: bytes
    render_seconds: float

    @property
    def n_static(self) -> int:
        return len(self.packed_ids) // 4

    @property
    def static_ids(self) -> list[int]:
        ids = array(_U32)
        ids.frombytes(self.packed_ids)
        if _SWAP:
            ids.byteswap()
        return ids.tolist()


def encode_entry(key: str, check: int, static_ids: Sequence[int], render_seconds: float) -> bytes:
    """Serialize one entry; token ids must fit in uint32."""
    key_bytes = key.encode()
    ids = pack_ids(static_ids)
    render_us = min(max(int(render_seconds * 1e6), 0), _MAX_RENDER_US)
    body = (
        _HEADER.pack(MAGIC, VERSION, len(key_bytes), check, render_us, len(ids) // 4)
        + key_bytes
        + ids
    )
    return body + _DIGEST.pack(xxhash.xxh3_64_intdigest(body))


def decode_entry(data: bytes, key: str, check: int) -> Entry:
    """Parse and verify an entry read under ``key``; raise EntryError if it is not ours."""
    if len(data) < _HEADER.size + _DIGEST.size:
        raise EntryError("entry truncated")
    magic, version, key_len, stored_check, render_us, n_ids = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise EntryError("not a static-prefix entry")
    if version != VERSION:
        raise EntryError(f"entry format version {version}, expected {VERSION}")
    body_len = _HEADER.size + key_len + 4 * n_ids
    if len(data) != body_len + _DIGEST.size:
        raise EntryError("entry length does not match its header")
    (digest,) = _DIGEST.unpack_from(data, body_len)
    if digest != xxhash.xxh3_64_intdigest(memoryview(data)[:body_len]):
        raise EntryError("entry digest mismatch (corrupted)")
    stored_key = bytes(data[_HEADER.size : _HEADER.size + key_len]).decode(errors="replace")
    if stored_key != key:
        raise EntryError("entry belongs to another key")
    if stored_check != check:
        raise EntryError("entry check value mismatch (key collision)")
    return Entry(key, stored_check, bytes(data[_HEADER.size + key_len : body_len]), render_us / 1e6)
