"""The cache's renderer: a plan's prompt and its probe conversations rendered to text.

``PromptText`` is the plain one: every text through the renderer's own ``apply_chat_template``.
The accelerated one (``prefix_cache.fastpath``'s ``FastPromptText``) wraps it and gives the
same texts; ``StaticPrefixCache`` picks one of the two when it is made.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..render.render import DEFAULT_OPTIONS, RenderOptions
from ._plan import Plan

__all__ = ["Plan", "PromptText"]  # Plan: what the renderers take


class PromptText:
    """Renders through ``apply_chat_template`` (the plain path)."""

    def render(self, plan: Plan, messages: Sequence[Mapping[str, Any]],
               tools: list[Mapping[str, Any]] | None,
               options: RenderOptions = DEFAULT_OPTIONS) -> str:
        """The text of ``messages`` (the plan's own, or a probe conversation of its static
        part) with ``tools`` and the plan's kwargs."""
        return plan.renderer.render_text(messages, tools, plan.kwargs, options)
