"""Where a rendered prompt may be cut for tokenization: the safe-split rule of a tokenizer, and
the search for a split in a static text (run on a miss).

A fast tokenizer (a ``tokenizers`` backend) tokenizes text in stages: the added tokens that are
not normalized are cut out of the raw text first (leftmost-longest), each piece between them is
normalized, cut at the normalized added tokens and pre-tokenized, and each pre-token is encoded
by the model on its own. A prompt ``T`` that starts with a stored static text ``S`` is then

    ids(T) = stored[:index] + ids(T[anchor:])

whatever follows ``S``, when the cut at ``anchor`` is one the tokenizer makes there in any text
that starts with ``S``. Two kinds of cut qualify:

- **special split** (any fast tokenizer): ``S`` ends with an added token matched on the raw text
  (``normalized=False``; not ``rstrip``, which would take the whitespace after it; not
  ``single_word``, which looks at the next character; no longer added token starts with it; not
  a special token when the tokenizer splits those), and no added token can start inside ``S`` and
  end past it (no proper prefix of one is a suffix of ``S``). Everything before the token is then
  fixed by ``S`` alone. The anchor is the token's own start, so what follows it is tokenized in
  the same context as in ``T``: a piece that does not start the text (Metaspace's
  ``prepend_scheme="first"`` stays off), after the same character (``single_word`` neighbours).
  An ``lstrip`` token takes whitespace only from inside ``S``.
- **line split** (tokenizers whose pipeline only acts locally: no normalizer or a Unicode
  normalization form, regex ``Split`` / ``ByteLevel`` / ``Digits`` pre-tokenizers without
  look-behind or anchors, a BPE model, and no added token holding a line break): the start of a
  line inside ``S`` (after ``\\n``, at a non-space ASCII character), followed inside ``S`` by at
  least ``LINE_MARGIN_LINES`` more line starts and ``LINE_MARGIN_CHARS`` characters. Such
  pre-tokenizers decide each pre-token from at most a few runs of characters of one class plus
  one character of look-ahead, and a line start ends every run, so the margin (part of ``S``)
  keeps every decision before the anchor away from the request's own text. A self-test of the
  pre-tokenizer (``\\n`` then any non-space ASCII character always starts a pre-token) gates it.
  This is what lets a template that puts its tools in the first user turn (Llama 3.x) cut after
  most of the tools rather than before all of them.

A candidate is kept only if the anchored tokenization reproduces both probes' ids from the same
index, and the cache re-checks the fast path against a full tokenization at a sampled rate.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ..util.prefix_len import common_prefix_len
from .tokenizer_model import TokenizerModel

Tokenize = Callable[[str], list[int]]

LINE_MARGIN_LINES = 2
LINE_MARGIN_CHARS = 64
MAX_VERIFIED = 4          # candidates verified per miss (each costs two tail tokenizations)
_WINDOW = 1024            # characters searched for candidates first (doubled as needed)

_SELF_TEST_HEADS = ("x", "X", "1", " ", "  ", "}", "\"", ".", ",", ":", "é", "\t", "\n", "'s")


@dataclass(frozen=True, slots=True)
class StaticSplit:
    """A safe cut of a static text: ids before ``index`` are the stored ones; tokenizing a
    prompt from ``anchor`` on gives the rest (starting with the stored id at ``index``), for
    any prompt that starts with ``text``."""

    text: str
    anchor: int
    index: int


class SplitRule:
    """One tokenizer's safe-split rule (its ``TokenizerModel`` read once): which added tokens
    may end a split, which texts no added token can cross, and whether line splits are
    allowed (``off`` / ``lines_off`` say why not)."""

    def __init__(self, model: TokenizerModel) -> None:
        self.off = model.off
        self.lines_off: str | None = model.lines_off()
        self._prefixes: frozenset[str] = frozenset()
        self._longest = 0
        self._ends: re.Pattern[str] | None = None
        self._line_start: re.Pattern[str] | None = None
        if self.off is None:
            self._read_added_tokens(model)
            if self.lines_off is None:
                heads = line_heads(model.backend)
                if heads:
                    self._line_start = re.compile("\n(?=[" + re.escape(heads) + "])")
                else:
                    self.lines_off = "the pre-tokenizer does not start a pre-token at line starts"

    def _read_added_tokens(self, model: TokenizerModel) -> None:
        added, raw, split_specials = model.added, model.raw_added, model.split_special_tokens
        contents = sorted({t.content for t in raw})
        # Strings that start with c sort right after c: one look at the next one tells.
        extended = {c for c, after in zip(contents, contents[1:], strict=False)
                    if after.startswith(c)}
        eligible = sorted(
            {t.content for t in raw
             if not t.rstrip and not t.single_word and not (t.special and split_specials)
             and t.content not in extended},
            key=len, reverse=True)
        # Any added token (either stage) that could start before a cut and end after it.
        self._prefixes = frozenset(t.content[:k] for t in added for k in range(1, len(t.content)))
        self._longest = max((len(t.content) for t in added), default=0)
        if eligible:
            self._ends = re.compile("(?=(" + "|".join(map(re.escape, eligible)) + "))")

    def crosses(self, text: str, cut: int) -> bool:
        """Whether an added token could start inside ``text[:cut]`` and end after it."""
        tail = text[max(0, cut - self._longest):cut]
        return any(tail[-k:] in self._prefixes for k in range(1, len(tail) + 1))

    def candidates(self, text: str, end: int) -> Iterator[tuple[int, int]]:
        """(anchor, text end) of possible cuts in ``text[:end]``, the latest first."""
        if self.off is not None:
            return
        start = end
        seen: set[int] = set()
        width = _WINDOW
        while start > 0:
            lo = max(0, end - width)
            found = sorted(self._window(text, lo, end), reverse=True)
            for cut in found:
                if cut[0] not in seen and cut[0] < start:
                    seen.add(cut[0])
                    yield cut
            start = lo
            width *= 4

    def _window(self, text: str, lo: int, end: int) -> list[tuple[int, int]]:
        out = []
        if self._ends is not None:
            for m in self._ends.finditer(text, lo, end):
                stop = m.start() + len(m.group(1))
                if stop <= end and not self.crosses(text, stop):
                    out.append((m.start(), stop))  # special split: S ends with the token
        if self._line_start is not None:
            starts = [m.start() + 1 for m in self._line_start.finditer(text, lo, end)]
            for n, a in enumerate(starts):
                after = len(starts) - n - 1
                if (after >= LINE_MARGIN_LINES and end - a >= LINE_MARGIN_CHARS
                        and not self.crosses(text, a)):
                    out.append((a, end))  # line split: S is the whole static text
        return out


# Why a text was not tokenized from a split (``tail_from_split``).
TEXT_DIFFERS = "text_differs"  # the text does not start with the split's static text
ANCHOR = "anchor"              # the tail did not start with the token the split was verified at


def tail_from_split(split: StaticSplit, anchor_id: int | None, tokenize: Tokenize,
                    text: str) -> tuple[list[int] | None, str]:
    """The tokenization of ``text`` from the split's anchor (its ids are then the stored ones
    before ``split.index`` and these), and ``""``; or None and why not: ``text`` does not start
    with the split's static text, or the tail does not start with ``anchor_id``, the stored id
    at ``split.index`` (a cheap guard, not a proof; None when there is none)."""
    if not text.startswith(split.text):
        return None, TEXT_DIFFERS
    tail = tokenize(text[split.anchor:])
    if not tail or anchor_id is None or tail[0] != anchor_id:
        return None, ANCHOR
    return tail, ""


def find_split(rule: SplitRule, tokenize: Tokenize, text_a: str, ids_a: list[int],
               text_b: str, ids_b: list[int], n_static: int) -> StaticSplit | None:
    """The latest safe cut in the probes' common text whose anchored tokenization reproduces
    both probes' ids from one index inside the scaffold (``n_static`` ids), or None."""
    end = common_prefix_len(text_a, text_b)
    for tries, (anchor, stop) in enumerate(rule.candidates(text_a, end)):
        if tries >= MAX_VERIFIED:
            break
        tail_a = tokenize(text_a[anchor:])
        index = len(ids_a) - len(tail_a)
        if not tail_a or not 0 <= index < n_static or ids_a[index:] != tail_a:
            continue
        tail_b = tokenize(text_b[anchor:])
        if len(ids_b) - len(tail_b) == index and ids_b[index:] == tail_b:
            return StaticSplit(text_a[:stop], anchor, index)
    return None


# -- what a tokenizer allows ----------------------------------------------------------------------


def line_heads(backend: Any) -> str:
    """The ASCII characters that start a pre-token after ``\n`` whatever came before (a
    self-test of a tokenizers backend's pre-tokenizer on every printable character, after
    several contexts)."""
    pre = backend.pre_tokenizer
    heads = [chr(c) for c in range(0x21, 0x7F)]
    safe = set(heads)
    for before in _SELF_TEST_HEADS:
        text = "".join(f"{before}\n{head}{head}" for head in heads)
        starts = {start for _, (start, _) in pre.pre_tokenize_str(text)}
        at = len(before) + 1
        for head in heads:
            if at not in starts:
                safe.discard(head)
            at += len(before) + 3
    return "".join(sorted(safe))


def split_rule(tokenizer: Any, split_special_tokens: bool | None = None) -> SplitRule:
    """The rule of ``tokenizer`` as it is now, built here (its owner keeps it: the accelerated
    prompt tokenizer, per tokenizer state); ``split_special_tokens``: the flag as that state
    has it (read now when None)."""
    return SplitRule(TokenizerModel(tokenizer, split_special_tokens))
