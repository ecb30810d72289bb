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

import json
import re
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

Tokenize = Callable[[str], list[int]]

LINE_MARGIN_LINES = 2
LINE_MARGIN_CHARS = 64
MAX_VERIFIED = 4          # candidates verified per miss (each costs two tail tokenizations)
_WINDOW = 1024            # characters searched for candidates first (doubled as needed)

_LOCAL_NORMALIZERS = frozenset(("NFC", "NFD", "NFKC", "NFKD"))
# Regex features that make a pre-token depend on what came before it, or on where it stands.
_NON_LOCAL_REGEX = re.compile(r"\(\?<[=!]|\\[bBAzZG]|(?<![\\\[])\^|(?<!\\)\$")
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
    """One tokenizer's safe-split rule: which added tokens may end a split, which texts no
    added token can cross, and whether line splits are allowed (``off`` / ``lines_off`` say
    why not)."""

    def __init__(self, tokenizer: Any, split_special_tokens: bool | None = None) -> None:
        self.off = _tokenizer_off(tokenizer)
        self.lines_off: str | None = self.off
        self._prefixes: frozenset[str] = frozenset()
        self._longest = 0
        self._ends: re.Pattern[str] | None = None
        self._line_start: re.Pattern[str] | None = None
        if self.off is None:
            self._read_added_tokens(tokenizer, split_special_tokens)
            if self.lines_off is None:
                self.lines_off = _lines_off(tokenizer)
            if self.lines_off is None:
                heads = line_heads(tokenizer)
                if heads:
                    self._line_start = re.compile("\n(?=[" + re.escape(heads) + "])")
                else:
                    self.lines_off = "the pre-tokenizer does not start a pre-token at line starts"

    def _read_added_tokens(self, tokenizer: Any, split_specials: bool | None) -> None:
        added = list(tokenizer.added_tokens_decoder.values())
        raw = [t for t in added if not t.normalized and t.content]
        if split_specials is None:
            split_specials = bool(getattr(tokenizer, "split_special_tokens", False))
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
        if any("\n" in t.content or "\r" in t.content for t in added):
            self.lines_off = "an added token holds a line break"

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
    end = common_text_len(text_a, text_b)
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


def common_text_len(a: str, b: str) -> int:
    """Length of the longest common prefix of two strings (slice compares, no Python loop
    over the characters)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # first lo equal, first hi differ
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


# -- what a tokenizer allows ----------------------------------------------------------------------


def _tokenizer_off(tokenizer: Any) -> str | None:
    """Why this tokenizer has no safe split at all, or None."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # pragma: no cover - another transformers layout
        return "unknown transformers tokenizer layout"
    if getattr(tokenizer, "backend_tokenizer", None) is None:
        return "slow tokenizer (no tokenizers backend)"
    kind = type(tokenizer)
    if (getattr(kind, "_encode_plus", None) is not TokenizersBackend._encode_plus
            or kind.__call__ is not PreTrainedTokenizerBase.__call__
            or kind.encode is not PreTrainedTokenizerBase.encode):
        return f"{kind.__name__} encodes its own way"
    return None


def _lines_off(tokenizer: Any) -> str | None:
    """Why line splits are not allowed for this tokenizer, or None (components read one by
    one: serializing the whole backend would copy its vocabulary)."""
    backend = tokenizer.backend_tokenizer
    normalizer = backend.normalizer
    pre_tokenizer = backend.pre_tokenizer
    return (_normalizer_off(None if normalizer is None else json.loads(normalizer.__getstate__()))
            or _pre_tokenizer_off(None if pre_tokenizer is None
                                  else json.loads(pre_tokenizer.__getstate__()))
            or (None if type(backend.model).__name__ == "BPE" else "the model is not BPE"))


def _normalizer_off(node: Any) -> str | None:
    if node is None:
        return None
    kind = node.get("type")
    if kind == "Sequence":
        return next(filter(None, map(_normalizer_off, node.get("normalizers", []))), None)
    return None if kind in _LOCAL_NORMALIZERS else f"normalizer {kind} acts across a cut"


def _pre_tokenizer_off(node: Any) -> str | None:
    if node is None:
        return "no pre-tokenizer (one pre-token per piece)"
    kind = node.get("type")
    if kind == "Sequence":
        parts = node.get("pretokenizers", [])
        if not parts:
            return "no pre-tokenizer (one pre-token per piece)"
        return next(filter(None, map(_pre_tokenizer_off, parts)), None)
    if kind == "ByteLevel":
        return "ByteLevel adds a prefix space" if node.get("add_prefix_space") else None
    if kind == "Digits":
        return None
    if kind == "Split":
        pattern = (node.get("pattern") or {}).get("Regex")
        if pattern is None or node.get("behavior") != "Isolated" or node.get("invert"):
            return "a Split pre-tokenizer other than an isolated regex"
        if _NON_LOCAL_REGEX.search(pattern):
            return "a pre-tokenizer regex with look-behind or anchors"
        return None
    return f"pre-tokenizer {kind} acts across a cut"


def line_heads(tokenizer: Any) -> str:
    """The ASCII characters that start a pre-token after ``\n`` whatever came before (a
    self-test of the pre-tokenizer on every printable character, after several contexts)."""
    pre = tokenizer.backend_tokenizer.pre_tokenizer
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


# -- memo: one rule per tokenizer state ----------------------------------------------------------

_rules: weakref.WeakKeyDictionary[Any, tuple[bytes, SplitRule]] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def split_rule(tokenizer: Any, digest: bytes,
               split_special_tokens: bool | None = None) -> SplitRule:
    """The rule of ``tokenizer`` in the state its fingerprint ``digest`` names (built once);
    ``split_special_tokens``: the flag as that state has it (read now when None)."""
    memo = _rules.get(tokenizer)
    if memo is not None and memo[0] == digest:
        return memo[1]
    rule = SplitRule(tokenizer, split_special_tokens)
    with _lock:
        _rules[tokenizer] = (digest, rule)
    return rule
