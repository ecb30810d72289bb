"""Generated token ids as text: incremental decoding that never splits a character, and stop
strings that end the text where they first appear."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from prefix_cache.render.render import unwrap_tokenizer

REPLACEMENT = "\ufffd"
# A UTF-8 character is at most 4 bytes, so at most 4 byte-level tokens; past that a trailing
# U+FFFD is the model's own output, not a character still being assembled.
MAX_HELD_TOKENS = 6


class IncrementalDecoder:
    """Text of a growing list of token ids, as deltas that never split a character.

    Each step decodes a short window (the last emitted token(s) plus the new ones) and emits
    what the new ids added; while the window's text ends in U+FFFD (an incomplete UTF-8
    sequence) nothing is emitted, for up to ``MAX_HELD_TOKENS`` tokens. ``flush`` emits what is
    left. The deltas concatenated equal ``decode(all ids)``.

    Special tokens are left out of the text, except those in ``keep``: markers the engine reads
    the text by (a tool call's or a reasoning block's), which a tokenizer may mark special.
    """

    def __init__(self, tokenizer: Any, keep: Iterable[int] = ()) -> None:
        self._tokenizer = unwrap_tokenizer(tokenizer)
        self._ids: list[int] = []
        self._prefix = 0   # window start: the tokens before it are emitted and stay emitted
        self._read = 0     # tokens up to here are emitted
        self._drop = special_ids(self._tokenizer) - set(keep) if keep else None

    def _decode(self, ids: Sequence[int]) -> str:
        if self._drop is None:
            return str(self._tokenizer.decode(list(ids), skip_special_tokens=True))
        kept = [i for i in ids if i not in self._drop]
        return str(self._tokenizer.decode(kept, skip_special_tokens=False))

    def add(self, token: int) -> str:
        self._ids.append(int(token))
        return self._step(final=False)

    def flush(self) -> str:
        return self._step(final=True)

    def _step(self, final: bool) -> str:
        if self._read == len(self._ids):
            return ""
        before = self._decode(self._ids[self._prefix:self._read])
        text = self._decode(self._ids[self._prefix:])
        held = len(self._ids) - self._read
        if not final and text.endswith(REPLACEMENT) and held < MAX_HELD_TOKENS:
            return ""
        if len(text) <= len(before) and not final:
            return ""  # a window that decodes no longer (yet): wait for the next token
        delta = text[len(before):] if len(text) > len(before) else ""
        self._prefix, self._read = self._read, len(self._ids)
        return delta


def special_ids(tokenizer: Any) -> set[int]:
    """The ids ``decode(skip_special_tokens=True)`` leaves out: the added tokens marked special
    and the tokenizer's named special tokens."""
    inner = unwrap_tokenizer(tokenizer)
    added = getattr(inner, "added_tokens_decoder", {}) or {}
    ids = {int(i) for i, token in added.items() if getattr(token, "special", False)}
    return ids | {int(i) for i in getattr(inner, "all_special_ids", ()) or ()}


class StopStrings:
    """Text deltas cut at the first stop string: ``feed`` returns what is safe to emit now
    (text that might be the start of a stop string is held back) and whether a stop was hit."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self.matched: str | None = None  # the stop string that was hit
        self._pending = ""

    def feed(self, text: str, final: bool = False) -> tuple[str, bool]:
        """``(text to emit, stopped)``; at ``final`` everything held is released."""
        pending = self._pending + text
        if not self.stops:
            self._pending = ""
            return pending, False
        found = [(i, s) for s in self.stops if (i := pending.find(s)) >= 0]
        if found:
            cut, self.matched = min(found, key=lambda f: f[0])
            self._pending = ""
            return pending[:cut], True
        keep = 0 if final else _stop_hold(pending, self.stops)
        self._pending = pending[len(pending) - keep:]
        return pending[:len(pending) - keep], False


def _stop_hold(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that some stop string starts with."""
    best = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:n]):
                best = n
                break
    return best
