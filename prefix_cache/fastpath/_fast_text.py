"""The accelerated renderer of a cache: ``PromptText``'s texts, rendered directly.

A plan's texts whose tools and kwargs are in its key (plain data, checked when the key was
packed) are rendered by ``_direct_render`` (transformers' steps without their defensive copies,
the tools' ``tojson`` texts remembered per key in this object's memo), where the renderer is a
bare transformers tokenizer whose ``apply_chat_template`` is the base class's. Anything else is
the plain renderer's. The first direct render of each renderer is compared with the plain one;
a difference, or a sampled check's (``direct_off``), turns the direct render off for that
renderer, logged once.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..cache.prompt_text import Plan, PromptText
from ..errors import TemplateRenderError
from ..render.render import (
    DEFAULT_OPTIONS,
    RenderOptions,
    TemplateRenderer,
    randomness_seen,
    template_message,
)
from . import _direct_render

log = logging.getLogger("prefix_cache")
MAX_RENDERERS = 1024   # renderers whose direct render this object remembers


@dataclass(slots=True)
class _Direct:
    """One renderer's direct render: its compiled template (None: off), and whether its first
    render was compared with the plain one."""

    template: Any
    checked: bool = False


class FastPromptText(PromptText):
    """``PromptText``'s texts, rendered directly where the renderer allows (module docstring)."""

    def __init__(self, plain: PromptText | None = None) -> None:
        self.plain = plain or PromptText()
        self.tojson = _direct_render.TojsonMemo()
        self._direct: dict[bytes, _Direct] = {}   # renderer identity -> its direct render
        self._lock = threading.Lock()

    def render(self, plan: Plan, messages: Sequence[Mapping[str, Any]],
               tools: list[Mapping[str, Any]] | None,
               options: RenderOptions = DEFAULT_OPTIONS) -> str:
        renderer = plan.renderer
        direct = self._for(renderer) if plan.static is not None and options == DEFAULT_OPTIONS \
            and _direct_render.takes(renderer.tokenizer, plan.kwargs) else None
        if direct is None or direct.template is None:
            return self.plain.render(plan, messages, tools, options)
        # The plan's own messages may be the body parser's JSON; a probe's never are.
        json_messages = plan.json_messages and messages is plan.messages
        memo_key = (plan.key, plan.check) if plan.key else None
        with randomness_seen() as drawn:
            try:
                text = self.render_direct(direct.template, plan, messages, tools, memo_key,
                                          json_messages)
            except Exception as exc:
                raise TemplateRenderError(template_message(exc)) from exc
            finally:
                if drawn:
                    renderer.drew(drawn[0])
        if not direct.checked:
            plain = self.plain.render(plan, messages, tools, options)
            if plain != text:
                self.direct_off(renderer, "the first direct render differs from "
                                          "apply_chat_template's")
                return plain
            direct.checked = True
        return text

    def compile(self, renderer: TemplateRenderer) -> Any:
        """The renderer's template compiled for ``render_direct`` (None: it cannot be)."""
        return _direct_render.compiled(renderer.target, renderer.template)

    def render_direct(self, template: Any, plan: Plan, messages: Sequence[Mapping[str, Any]],
                      tools: list[Mapping[str, Any]] | None, memo_key: tuple[str, int] | None,
                      json_messages: bool) -> str:
        """One direct render (``_direct_render.render``) with this object's tojson memo."""
        return _direct_render.render(template, plan.renderer.tokenizer, messages, tools,
                                     plan.kwargs, self.tojson, memo_key, json_messages)

    def renders_direct(self, renderer: TemplateRenderer) -> bool:
        """Whether this renderer's texts are rendered directly (compiled and not off)."""
        found = self._direct.get(renderer.identity)
        return found is not None and found.template is not None

    def direct_off(self, renderer: TemplateRenderer, reason: str) -> None:
        """Render this renderer's texts the plain way from now on (logged once)."""
        with self._lock:
            found = self._direct.get(renderer.identity)
            if found is not None and found.template is None:
                return  # off already
            self._direct[renderer.identity] = _Direct(None, True)
        log.warning("direct template render off for this renderer: %s", reason)

    def remembered_tojson(self, key: str) -> dict[tuple[int, Any], str]:
        """The ``tojson`` texts remembered under the cache key ``key`` (a read-only snapshot):
        (the tool's place, its call's typed arguments, or None for the default call) -> text."""
        return self.tojson.remembered(key)

    def _for(self, renderer: TemplateRenderer) -> _Direct | None:
        """The renderer's direct render, compiled on its first use (None: a wrapper)."""
        if renderer.wrapped:
            return None
        found = self._direct.get(renderer.identity)
        if found is None:
            found = _Direct(self.compile(renderer))
            with self._lock:
                if len(self._direct) >= MAX_RENDERERS:
                    del self._direct[next(iter(self._direct))]
                found = self._direct.setdefault(renderer.identity, found)
        return found
