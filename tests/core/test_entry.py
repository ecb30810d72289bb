"""The binary entry: round trip, and every kind of damage detected."""

from __future__ import annotations

import struct

import pytest
import xxhash

from prefix_cache.cache.entry import VERSION, decode_entry, encode_entry
from prefix_cache.errors import EntryError
from prefix_cache.render.split import StaticSplit

KEY, CHECK = "spc:default:m:00ff", 0x1234_5678_9ABC_DEF0
IDS = [0, 1, 151643, 2**32 - 1, 42] * 100


def test_round_trip() -> None:
    entry = decode_entry(encode_entry(KEY, CHECK, IDS, 0.0375), KEY, CHECK)
    assert entry.static_ids == IDS and entry.key == KEY and entry.check == CHECK
    assert entry.render_seconds == pytest.approx(0.0375, abs=1e-6)


def test_compact() -> None:
    assert len(encode_entry(KEY, CHECK, IDS, 0.01)) == 4 * len(IDS) + len(KEY) + 28 + 8


def test_empty_ids_round_trip() -> None:
    assert decode_entry(encode_entry(KEY, CHECK, [], 0.0), KEY, CHECK).static_ids == []


def _flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0x01]) + data[at + 1:]


GOOD = encode_entry(KEY, CHECK, IDS, 0.01)
DAMAGE = {
    "empty": b"",
    "random bytes": bytes(range(256)) * 3,
    "truncated": GOOD[:-9],
    "one byte short": GOOD[:-1],
    "one byte extra": GOOD + b"\x00",
    "flipped token id": _flip(GOOD, len(GOOD) - 20),
    "flipped header": _flip(GOOD, 12),
    "other version": GOOD[:4] + bytes([VERSION + 1]) + GOOD[5:],
}


@pytest.mark.parametrize("name", sorted(DAMAGE))
def test_damage_is_detected(name: str) -> None:
    with pytest.raises(EntryError):
        decode_entry(DAMAGE[name], KEY, CHECK)


def test_foreign_key_detected() -> None:
    with pytest.raises(EntryError, match="another key"):
        decode_entry(GOOD, KEY + "0", CHECK)


def test_collision_detected_by_check_value() -> None:
    with pytest.raises(EntryError, match="collision"):
        decode_entry(GOOD, KEY, CHECK ^ 1)


def test_token_ids_out_of_range_refused() -> None:
    with pytest.raises(OverflowError):
        encode_entry(KEY, CHECK, [2**32], 0.0)
    with pytest.raises(OverflowError):
        encode_entry(KEY, CHECK, [-1], 0.0)


# -- the split section (format 3) -----------------------------------------------------------

SPLIT = StaticSplit("<|im_start|>system\nBe brief. é<|im_end|>\n<|im_start|>", 38, 7)
WITH_SPLIT = encode_entry(KEY, CHECK, IDS, 0.01, split=SPLIT)


def test_split_round_trip() -> None:
    entry = decode_entry(WITH_SPLIT, KEY, CHECK)
    assert entry.split == SPLIT and entry.static_ids == IDS
    assert decode_entry(GOOD, KEY, CHECK).split is None


def test_a_version_2_entry_is_read_as_one_without_a_split() -> None:
    """Replicas still on the previous release wrote format 2: it reads, without a split."""
    body = GOOD[:-8]
    v2 = body[:4] + bytes([2]) + body[5:]
    v2 += struct.pack("<Q", xxhash.xxh3_64_intdigest(v2))
    entry = decode_entry(v2, KEY, CHECK)
    assert entry.static_ids == IDS and entry.split is None


def _resealed(body: bytes) -> bytes:
    return body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))


SPLIT_AT = len(WITH_SPLIT) - 8 - len(SPLIT.text.encode()) - 12
SPLIT_DAMAGE = {
    "text cut short": _resealed(WITH_SPLIT[:-9]),
    "anchor past the text": _resealed(WITH_SPLIT[:SPLIT_AT] + struct.pack("<I", 10_000)
                                      + WITH_SPLIT[SPLIT_AT + 4:-8]),
    "index past the ids": _resealed(WITH_SPLIT[:SPLIT_AT + 4] + struct.pack("<I", len(IDS))
                                    + WITH_SPLIT[SPLIT_AT + 8:-8]),
    "not UTF-8": _resealed(WITH_SPLIT[:-9] + b"\xff"),
    "flag without a section": _resealed(GOOD[:5] + bytes([GOOD[5] | 0x02]) + GOOD[6:-8]),
    "flipped text": _flip(WITH_SPLIT, len(WITH_SPLIT) - 12),
}


@pytest.mark.parametrize("name", sorted(SPLIT_DAMAGE))
def test_split_damage_is_detected(name: str) -> None:
    with pytest.raises(EntryError):
        decode_entry(SPLIT_DAMAGE[name], KEY, CHECK)


def test_decoded_entries_answer_as_decode_entry() -> None:
    """The decoded-entry memo gives back its entry only for the bytes it came from, under the
    same key and check value; anything else is decoded (and refused) as ``decode_entry`` would."""
    from prefix_cache.cache.entry import DecodedEntries

    memo = DecodedEntries()
    split = StaticSplit("<|im_start|>system\nHi", 3, 2)
    data = encode_entry(KEY, CHECK, IDS, 0.01, split=split)
    first = memo.decode(data, KEY, CHECK)
    assert first == decode_entry(data, KEY, CHECK)
    assert memo.decode(data, KEY, CHECK) is first              # the same bytes object
    assert memo.decode(bytes(bytearray(data)), KEY, CHECK) is first   # equal bytes (a Redis read)
    with pytest.raises(EntryError, match="check value"):
        memo.decode(data, KEY, CHECK ^ 1)
    with pytest.raises(EntryError, match="another key"):
        memo.decode(data, KEY + "0", CHECK)
    for name, damaged in DAMAGE.items():
        with pytest.raises(EntryError):
            memo.decode(damaged, KEY, CHECK)
        assert memo.decode(data, KEY, CHECK) == first, name
    other = encode_entry(KEY, CHECK, IDS[:5], 0.02)  # a new value under the key replaces it
    assert memo.decode(other, KEY, CHECK).static_ids == IDS[:5]
    assert memo.decode(data, KEY, CHECK).static_ids == IDS
