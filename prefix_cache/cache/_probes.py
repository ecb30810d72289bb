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

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from . import boundary
from ..errors import TemplateRenderError
from ..render.render import TemplateRenderer, tool_choices
from ..render.split import SplitRule, StaticSplit, find_split, tail_from_split

NO_SPLIT_HERE = "no safe split in this static text"

# Renders a conversation with a tools argument to text (the cache's renderer, bound to a plan).
Render = Callable[[Sequence[Mapping[str, Any]], list[Mapping[str, Any]] | None], str]


@dataclass(frozen=True, slots=True)
class Probed:
    """What the probes of one static prefix found."""

    ids: list[int]              # the scaffold
    cap: int                    # where a multi-turn layout puts the first user text
    empty_tools: bool           # rendered with the tools=[] fallback
    renders: int                # probe renders run
    split: StaticSplit | None   # where prompts may be cut for tokenization
    split_off: str | None       # why there is no split


def probe(render: Render, renderer: TemplateRenderer, static: Sequence[Mapping[str, Any]],
          tools: list[dict[str, Any]] | None, rule: SplitRule | None) -> Probed:
    """Run the probes of ``static`` (four renders through ``render``; two more tail
    tokenizations per split candidate verified), tokenized by ``renderer``. ``rule``: where
    its texts may be cut (None: no split looked for)."""
    count = 0
    choices = tool_choices(tools)
    for i, choice in enumerate(choices):
        try:
            conv_a, conv_b = boundary.probe_conversations(static)
            count += 2
            text_a, text_b = render(conv_a, choice), render(conv_b, choice)
        except TemplateRenderError:
            if i == len(choices) - 1:
                raise
            continue
        ids_a, ids_b = renderer.tokenize(text_a), renderer.tokenize(text_b)
        ids = ids_a[: boundary.common_prefix_len(ids_a, ids_b)]
        if rule is None:  # off by configuration: not a finding to report
            split, off = None, None
        else:
            split = None if rule.off else find_split(rule, renderer.tokenize, text_a, ids_a,
                                                     text_b, ids_b, len(ids))
            off = rule.off if rule.off else (None if split else NO_SPLIT_HERE)
        cap_render = _CapRender(render, renderer, choice, split, ids_a)
        try:
            cap = boundary.text_start_cap(cap_render, static)
        except TemplateRenderError:
            cap = 0  # no multi-turn layout known: every other shape is checked on its own
        return Probed(ids, cap, tools is None and choice is not None, count + cap_render.count,
                      split, off)
    raise AssertionError("tool_choices is never empty")  # pragma: no cover


@dataclass(slots=True)
class _CapRender:
    """Renders a multi-turn probe the way the scaffold probes were rendered and tokenizes it
    from ``split`` (the stored ``ids`` up to it, then the probe's own tail) when its text
    allows, whole otherwise; counts its renders."""

    render: Render
    renderer: TemplateRenderer
    tools: Any
    split: StaticSplit | None
    ids: list[int]
    count: int = 0

    def __call__(self, conv: list[boundary.Message]) -> list[int]:
        self.count += 1
        text = self.render(conv, self.tools)
        if self.split is not None:
            index = self.split.index
            anchor_id = self.ids[index] if index < len(self.ids) else None
            tail, _ = tail_from_split(self.split, anchor_id, self.renderer.tokenize, text)
            if tail is not None:
                return self.ids[:index] + tail
        return self.renderer.tokenize(text)
