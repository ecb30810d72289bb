"""Token ids: checked once where they enter, and packed as little-endian uint32.

Entries store token ids as uint32, so an id outside [0, 2**32) could never be compared with a
stored one. Ids a caller gives are checked once, before anything is looked up or stored, so a
miss and a hit refuse the same inputs. The check is the packing itself (C speed, no Python loop
over the ids), and the packed bytes are kept for the prefix compare.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .errors import InvalidRequestError

TOKEN_ID_LIMIT = 2**32  # ids are stored as uint32
_U32 = next(code for code in "IL" if array(code).itemsize == 4)
_SWAP = sys.byteorder == "big"


def pack_ids(ids: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32 bytes; OverflowError or TypeError if one does not fit."""
    packed = array(_U32, ids)
    if _SWAP:
        packed.byteswap()
    return packed.tobytes()


def unpack_ids(packed: bytes) -> list[int]:
    """The inverse of ``pack_ids``."""
    ids = array(_U32)
    ids.frombytes(packed)
    if _SWAP:
        ids.byteswap()
    return ids.tolist()


@dataclass(frozen=True, slots=True)
class TokenIds:
    """A checked list of token ids and its packed form."""

    ids: list[int]
    packed: bytes

    @classmethod
    def of_rendered(cls, ids: list[int]) -> TokenIds:
        """Ids a tokenizer produced (trusted to fit)."""
        return cls(ids, pack_ids(ids))


def checked_token_ids(value: Any, what: str = "prompt_ids") -> TokenIds:
    """``value`` checked as token ids (integers in [0, 2**32)), with its packed form."""
    if not isinstance(value, (list, tuple)):
        raise InvalidRequestError(f"{what} must be a list of token ids, got {type(value).__name__}")
    try:
        packed = pack_ids(value)
    except (OverflowError, TypeError, ValueError):
        raise InvalidRequestError(_first_bad(value, what)) from None
    return TokenIds(value if isinstance(value, list) else list(value), packed)


def validate_token_ids(value: Any, what: str = "prompt_ids") -> list[int]:
    """``value`` as a list of token ids: integers in [0, 2**32); InvalidRequestError otherwise."""
    return checked_token_ids(value, what).ids


def _first_bad(value: Sequence[Any], what: str) -> str:
    for i, item in enumerate(value):
        try:
            pack_ids([item])
        except (OverflowError, TypeError, ValueError):
            return (f"{what}[{i}] is {item!r}: token ids must be integers in "
                    f"[0, {TOKEN_ID_LIMIT}) (2**32)")
    return f"{what} must be integers in [0, {TOKEN_ID_LIMIT})"  # pragma: no cover
