"""The miss: the probe renders of one static prefix, and what they tell.

Two probes give the scaffold (``boundary``: the common prefix of their ids) and, from their
texts, the safe split for tokenizing prompts (``split.find_split``); two multi-turn probes give
the cap. Each probe is rendered to text and tokenized the way the renderer's own ``apply`` does
it, so its ids are exactly the render's. The two scaffold probes are tokenized whole (they
define the answer and verify the split); the multi-turn probes start with the same static text,
so like any prompt they are tokenized from the split (the stored ids, then their own tail):
two short tokenizations instead of two of the whole static prefix. All probes of one
computation render with the same ``tools`` argument: the request's, or for a request without
tools whose probes fail on ``None``, ``[]``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from . import boundary
from ..errors import TemplateRenderError
from ..util.hints import FastPath
from ..render.render import TemplateRenderer, tool_choices
from ..render.split import StaticSplit, find_split, split_rule, tail_from_split

NO_SPLIT_HERE = "no safe split in this static text"


@dataclass(frozen=True, slots=True)
class Probed:
    """What the probes of one static prefix found."""

    ids: list[int]              # the scaffold
    cap: int                    # where a multi-turn layout puts the first user text
    empty_tools: bool           # rendered with the tools=[] fallback
    renders: int                # probe renders run
    split: StaticSplit | None   # where prompts may be cut for tokenization
    split_off: str | None       # why there is no split


def probe(renderer: TemplateRenderer, static: Sequence[Mapping[str, Any]],
          tools: list[dict[str, Any]] | None, kwargs: Mapping[str, Any],
          memo_key: tuple[str, int] | None = None, fast: FastPath | None = None) -> Probed:
    """Run the probes of ``static`` (four renders; two more tail tokenizations per split
    candidate verified). ``static``, ``tools`` and ``kwargs`` are the key's plain data;
    ``memo_key`` names it (the direct render's memo). ``fast`` None (the fast path off):
    rendered through ``apply_chat_template`` and tokenized whole, no split looked for."""
    count = 0
    choices = tool_choices(tools)
    for i, choice in enumerate(choices):
        try:
            conv_a, conv_b = boundary.probe_conversations(static)
            count += 2
            text_a = renderer.render_text(conv_a, choice, kwargs, fast=fast, memo_key=memo_key)
            text_b = renderer.render_text(conv_b, choice, kwargs, fast=fast, memo_key=memo_key)
        except TemplateRenderError:
            if i == len(choices) - 1:
                raise
            continue
        ids_a, ids_b = renderer.tokenize(text_a), renderer.tokenize(text_b)
        ids = ids_a[: boundary.common_prefix_len(ids_a, ids_b)]
        rule = split_rule(renderer.tokenizer, renderer.tokenizer_digest,
                          renderer.split_special_tokens) if fast is not None else None
        if rule is None:  # off by configuration: not a finding to report
            split, off = None, None
        else:
            split = None if rule.off else find_split(rule, renderer.tokenize, text_a, ids_a,
                                                     text_b, ids_b, len(ids))
            off = rule.off if rule.off else (None if split else NO_SPLIT_HERE)
        render = _CapRender(renderer, choice, kwargs, memo_key, split, ids_a, fast)
        try:
            cap = boundary.text_start_cap(render, static)
        except TemplateRenderError:
            cap = 0  # no multi-turn layout known: every other shape is checked on its own
        return Probed(ids, cap, tools is None and choice is not None, count + render.count,
                      split, off)
    raise AssertionError("tool_choices is never empty")  # pragma: no cover


@dataclass(slots=True)
class _CapRender:
    """Renders a multi-turn probe the way the scaffold probes were rendered and tokenizes it
    from ``split`` (the stored ``ids`` up to it, then the probe's own tail) when its text
    allows, whole otherwise; counts its renders."""

    renderer: TemplateRenderer
    tools: Any
    kwargs: Mapping[str, Any]
    memo_key: tuple[str, int] | None
    split: StaticSplit | None
    ids: list[int]
    fast: FastPath | None = None
    count: int = 0

    def __call__(self, conv: list[boundary.Message]) -> list[int]:
        self.count += 1
        text = self.renderer.render_text(conv, self.tools, self.kwargs, fast=self.fast,
                                         memo_key=self.memo_key)
        if self.split is not None:
            index = self.split.index
            anchor_id = self.ids[index] if index < len(self.ids) else None
            tail, _ = tail_from_split(self.split, anchor_id, self.renderer.tokenize, text)
            if tail is not None:
                return self.ids[:index] + tail
        return self.renderer.tokenize(text)
