"""A hit's tail tokenized piece by piece, pieces remembered per tenant.

A tokenizers backend cuts its input at every added token (``<|im_start|>``, ``<|im_end|>``...)
before anything else and encodes the text between them one piece at a time: normalizer,
pre-tokenizer and model never see across such a cut. So a text's ids are the ids of its pieces,
each encoded alone, in order, wherever the cuts fall exactly where the backend's own cutting
falls. An agent's tail is its conversation after the static prefix: every turn sends the
previous turns again, so with its pieces remembered a hit encodes only the new ones (a 50-turn
conversation was re-tokenized whole on every hit before).

Where that holds (``piece_cuts``, from ``TokenizerModel.pieces_alone``: the one model of a
tokenizer the split reads too): the backend splits special tokens out (``encode_special_tokens``
off), no added token that is matched before normalization strips whitespace around itself or
must stand as a single word (those look past the cut), and the pre-tokenizers are of the kinds
that act on each piece alone. The one that looks at a piece's place, Metaspace's
``prepend_scheme: first`` (a "▁" before the text at the very start of the input only), sees
the same either way: every piece but the first starts with an added token, so its text is not
at the start of the input in its own encoding either, and the first is where the tail starts
in both. The cuts are found by the same leftmost-longest search the backend makes (a regular
expression of the added tokens, longest first). Anything else: the tail is encoded whole, as
before. The sampled full check of ``prompt_tokens`` compares every fast prompt with a full
tokenization, this path included.

Pieces are remembered per tenant (scope) and tokenizer state, bounded in bytes (invariant 5: a
tenant cannot learn from timing which pieces another sent).
"""

from __future__ import annotations

import re
import threading
import weakref
from typing import Any

from ..util.lru import ByteLRU
from ..render.tokenizer_model import TokenizerModel

MEMO_BYTES = 32 << 20      # per cache (per worker)
_ENTRY_OVERHEAD = 120      # a key tuple, a list and the LRU's own bookkeeping, roughly


def piece_cuts(model: TokenizerModel) -> re.Pattern[str] | None:
    """The added tokens the backend cuts at before normalizing, as one leftmost-longest search;
    None where cutting a text there and encoding the pieces alone might not give its ids
    (``TokenizerModel.pieces_alone``: the model is of the state the key read, its
    ``split_special_tokens`` included)."""
    if not model.pieces_alone():
        return None
    contents = sorted({t.content for t in model.raw_added}, key=len, reverse=True)
    return re.compile("|".join(map(re.escape, contents))) if contents else None


def pieces(cuts: re.Pattern[str], text: str) -> list[str]:
    """``text`` cut before every added token the backend would match in it."""
    starts = [m.start() for m in cuts.finditer(text)]
    if not starts or starts[0] != 0:
        starts.insert(0, 0)
    return [text[a:b] for a, b in zip(starts, [*starts[1:], len(text)], strict=True)]


class PieceMemo:
    """Token ids of tail pieces, per (scope, tokenizer state, piece text); LRU in bytes."""

    def __init__(self, max_bytes: int = MEMO_BYTES) -> None:
        self._lru: ByteLRU[tuple[str, bytes, str], list[int]] = ByteLRU(max_bytes)
        self._lock = threading.Lock()
        # Each renderer's cuts (its backend and split flag are fixed for its life).
        self._cuts: weakref.WeakKeyDictionary[Any, re.Pattern[str] | None] = (
            weakref.WeakKeyDictionary())

    def cuts(self, renderer: Any) -> re.Pattern[str] | None:
        """``piece_cuts`` of the renderer's tokenizer (None: texts are encoded whole), looked
        at once per renderer."""
        with self._lock:
            if renderer in self._cuts:
                return self._cuts[renderer]
        model = renderer.tokenizer_model
        found = None if model is None else piece_cuts(model)
        with self._lock:
            self._cuts[renderer] = found
        return found

    def tokenize(self, renderer: Any, scope: str, text: str) -> list[int]:
        """``renderer.tokenize_tail(text)``, from remembered pieces where the renderer's
        tokenizer allows it (``cuts``)."""
        cuts = self.cuts(renderer)
        if cuts is None:
            return list(renderer.tokenize_tail(text))
        digest = renderer.tokenizer_digest
        keys = [(scope, digest, piece) for piece in pieces(cuts, text)]
        get = self._lru.get
        with self._lock:  # once for all pieces: a long conversation has hundreds
            found = [get(key) for key in keys]
        out: list[int] = []
        for key, ids in zip(keys, found, strict=True):
            if ids is None:
                piece = key[2]
                ids = renderer.tokenize_tail(piece)
                with self._lock:
                    self._lru.put(key, ids, 2 * len(piece) + 8 * len(ids) + _ENTRY_OVERHEAD)
            out += ids
        return out

    def __len__(self) -> int:
        return len(self._lru)
