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
from typing import Any

import numpy as np

from ..errors import InvalidRequestError

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


class TokenIds:
    """A checked sequence of token ids: its packed form, and the list of ints made from it on
    first use only. A hit builds the prompt's ids as stored bytes plus its tail's: the list of
    Python ints (~20 ns each, ~0.2 ms for 10,000 ids) is made only for a caller that reads it;
    the boundary and the count need the packed form alone."""

    __slots__ = ("_ids", "packed")

    def __init__(self, ids: list[int] | None, packed: bytes) -> None:
        self._ids = ids
        self.packed = packed

    @classmethod
    def of_rendered(cls, ids: list[int]) -> TokenIds:
        """Ids a tokenizer produced (trusted to fit)."""
        return cls(ids, pack_ids(ids))

    @property
    def ids(self) -> list[int]:
        """The ids as a list (made once; a race makes two equal lists, either is kept)."""
        if self._ids is None:
            self._ids = unpack_ids(self.packed)
        return self._ids

    def __len__(self) -> int:
        return len(self.packed) // 4

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TokenIds) and self.packed == other.packed

    def __hash__(self) -> int:
        return hash(self.packed)

    def __repr__(self) -> str:
        return f"TokenIds({self.ids!r})"


def checked_token_ids(value: Any, what: str = "prompt_ids") -> TokenIds:
    """``value`` checked as token ids (integers in [0, 2**32)), with its packed form.

    A list or tuple of ints, or ids an engine already holds as an array: a one-dimensional
    integer numpy array (``np.asarray`` of an mlx array), an ``array.array`` of 4-byte
    unsigned ints, or ``TokenIds``; an array is checked by its range and packed in one copy,
    without a Python int per id. Exactly those types: a subclass (a numpy masked array, a
    matrix, a list subclass) may hold or iterate to other values than its data, and is refused
    like any other array-like."""
    kind = type(value)
    if kind is TokenIds:
        return value
    if kind is array and value.typecode == _U32:
        return TokenIds(None, _swapped(value).tobytes())
    if kind is np.ndarray:
        return TokenIds(None, _packed_array(value, what))
    if kind is not list and kind is not tuple:
        raise InvalidRequestError(f"{what} must be a list of token ids or a plain integer "
                                  f"array, got {kind.__module__}.{kind.__qualname__}")
    try:
        packed = pack_ids(value)
    except (OverflowError, TypeError, ValueError):
        raise InvalidRequestError(_first_bad(value, what)) from None
    return TokenIds(value if isinstance(value, list) else list(value), packed)


def _swapped(ids: array) -> array:
    if not _SWAP:
        return ids
    swapped = array(_U32, ids)
    swapped.byteswap()
    return swapped


def _packed_array(ids: np.ndarray, what: str) -> bytes:
    if ids.ndim != 1 or ids.dtype.kind not in "iu":
        raise InvalidRequestError(f"{what} must be a one-dimensional array of integers, got "
                                  f"{ids.ndim} dimensions of {ids.dtype}")
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= TOKEN_ID_LIMIT):
        raise InvalidRequestError(f"{what} must be integers in [0, {TOKEN_ID_LIMIT}), got "
                                  f"values in [{int(ids.min())}, {int(ids.max())}]")
    return ids.astype("<u4", copy=False).tobytes()


def json_token_ids(value: Any, what: str = "prompt_ids") -> Any:
    """``value`` as a JSON body gave it, with ``true``/``false`` refused: they parse to Python
    bools, which pack as 1 and 0 (an in-process caller's ``True`` is the int 1, but a JSON
    ``true`` is no token id). Ids already packed (``TokenIds``: only integers made them) and
    anything that is not a list pass unchanged (the cache checks them)."""
    if type(value) is list and any(type(item) is bool for item in value):
        i, item = next((i, item) for i, item in enumerate(value) if type(item) is bool)
        raise InvalidRequestError(f"{what}[{i}] is {str(item).lower()}: token ids must be "
                                  f"integers in [0, {TOKEN_ID_LIMIT}) (2**32)")
    return value


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
