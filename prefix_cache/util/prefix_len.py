"""The one common-prefix length: of token ids, text or bytes, and of packed id arrays."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def common_prefix_len(a: Sequence[Any], b: Sequence[Any]) -> int:
    """Length of the longest common prefix of two sequences (token ids, text, bytes): slice
    compares halving the part not yet known, so no Python loop over the items and, in all,
    about one pass over them."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # invariant: the first lo items are equal, the first hi are not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def packed_prefix_len(a: bytes, b: bytes, width: int = 4) -> int:
    """Common prefix length, in items of ``width`` bytes, of two packed id arrays (memcmp only):
    the items before the first byte that differs."""
    return common_prefix_len(a, b) // width
