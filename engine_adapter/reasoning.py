"""A model's reasoning apart from its answer, for the families that write it between ``<think>``
and ``</think>`` (Qwen3, Qwen3.5, QwQ, DeepSeek R1 and its distills).

The rule: reasoning is the text between the markers at the very start of the output (leading
whitespace aside); everything after the end marker is the answer. A prompt that already ends
with the start marker (the generation prompt of Qwen3.5's and DeepSeek R1's templates opens
``<think>``) starts the output inside it. An output that does not start with the start marker
is all answer; one cut off before the end marker is all reasoning. A template switched off
(``enable_thinking=False`` renders an empty, closed block) leaves the prompt outside it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from prefix_cache.render.render import unwrap_tokenizer
from prefix_cache.util.token_ids import TokenIds, unpack_ids

from .tool_calls import _partial_suffix

THINK = ("<think>", "</think>")
PROMPT_TAIL = 8   # prompt tokens read for an open start marker (it and a newline or two)


@dataclass(frozen=True, slots=True)
class ThinkMarkers:
    """A family's reasoning markers and their token ids (kept when the text is decoded)."""

    start: str
    end: str
    ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Reasoning:
    """A piece of reasoning text (answer text passes as plain ``str``)."""

    text: str


def think_markers(tokenizer: Any) -> ThinkMarkers | None:
    """The tokenizer's reasoning markers: mlx-lm's (``think_start``/``think_end``) when it
    names them, else ``<think>``/``</think>`` when both are single tokens of the vocabulary;
    None for a family without them, or whose chat template never names them (a vocabulary
    shared with a thinking sibling does not make a model think)."""
    start, end = getattr(tokenizer, "think_start", None), getattr(tokenizer, "think_end", None)
    inner = unwrap_tokenizer(tokenizer)
    vocab = inner.get_vocab()
    if not (isinstance(start, str) and isinstance(end, str) and start and end):
        if not all(marker in vocab for marker in THINK):
            return None
        start, end = THINK
    template = getattr(inner, "chat_template", None)
    if not isinstance(template, str) or end not in template:
        return None
    return ThinkMarkers(start, end, tuple(vocab[m] for m in (start, end) if m in vocab))


def opens_inside(tokenizer: Any, prompt_ids: Sequence[int] | TokenIds,
                 markers: ThinkMarkers) -> bool:
    """Whether the prompt leaves generation inside reasoning: its text ends with the start
    marker (trailing whitespace aside)."""
    tail = (unpack_ids(prompt_ids.packed[-4 * PROMPT_TAIL:]) if isinstance(prompt_ids, TokenIds)
            else list(prompt_ids[-PROMPT_TAIL:]))   # packed ids: uint32, 4 bytes each
    text = unwrap_tokenizer(tokenizer).decode(tail, skip_special_tokens=False)
    return str(text).rstrip().endswith(markers.start)


class ReasoningSplitter:
    """Text deltas in; ``Reasoning`` pieces and answer text out, in order."""

    def __init__(self, markers: ThinkMarkers, inside: bool) -> None:
        self.start, self.end = markers.start, markers.end
        self._state = "reasoning" if inside else "head"   # head: the output's start, undecided
        self._trim = inside        # whitespace at the start of a part is the template's
        self._buffer = ""

    def feed(self, text: str, final: bool = False) -> list[str | Reasoning]:
        """What can be passed on now; at ``final`` everything held is released."""
        out: list[str | Reasoning] = []
        self._buffer += text
        if self._trim:
            self._buffer = self._buffer.lstrip()
            self._trim = not self._buffer
        if self._state == "head":
            head = self._buffer.lstrip()
            if head.startswith(self.start):
                self._buffer = head[len(self.start):].lstrip()
                self._state, self._trim = "reasoning", not self._buffer
            elif self.start.startswith(head) and not final:
                return out                      # all whitespace or a partial marker: held
            else:
                self._state = "answer"
        if self._state == "reasoning":
            cut = self._buffer.find(self.end)
            if cut >= 0:
                out.append(Reasoning(self._buffer[:cut].rstrip()))
                self._buffer = self._buffer[cut + len(self.end):].lstrip()
                self._state, self._trim = "answer", not self._buffer
            else:
                # Held: a partial end marker, and whitespace that may stand before it.
                keep = 0 if final else _partial_suffix(self._buffer, self.end)
                ready = self._buffer[:len(self._buffer) - keep]
                ready = ready if final else ready.rstrip()
                out.append(Reasoning(ready))
                self._buffer = self._buffer[len(ready):]
        if self._state == "answer":
            out.append(self._buffer)
            self._buffer = ""
        return [p for p in out if (p.text if isinstance(p, Reasoning) else p)]
