"""The accelerators of one cache, as the core asks them (``prefix_cache.util.hints.FastPath``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..util.hints import Hints
from . import _direct_render
from ._frozen_tools import FrozenTools
from ._known_parts import KnownParts
from ._tail_pieces import PieceMemo


class Accelerators:
    """The direct render (its ``tojson`` memo is per process, keyed by
    the cache key) and this cache's tail pieces."""

    def __init__(self) -> None:
        self._pieces = PieceMemo()

    def compile_template(self, tokenizer: Any, template: str | None) -> Any:
        return _direct_render.compiled(tokenizer, template)

    def renders_directly(self, tokenizer: Any, kwargs: Mapping[str, Any]) -> bool:
        return _direct_render.takes(tokenizer, kwargs)

    def render(self, compiled: Any, tokenizer: Any, messages: Sequence[Mapping[str, Any]],
               tools: Sequence[Mapping[str, Any]] | None, kwargs: Mapping[str, Any],
               memo_key: tuple[str, int] | None, json_messages: bool) -> str:
        return _direct_render.render(compiled, tokenizer, messages, tools, kwargs, memo_key,
                                     json_messages)

    def tokenize_tail(self, renderer: Any, scope: str, text: str) -> list[int]:
        return self._pieces.tokenize(renderer, scope, text)

    def remembered_pieces(self) -> int:
        """How many tail pieces this cache remembers (read-only, for tests and stats)."""
        return len(self._pieces)

    @staticmethod
    def remembered_tojson(key: str) -> dict[tuple[int, Any], str]:
        """The direct render's ``tojson`` texts remembered under the cache key ``key`` (a
        read-only snapshot): (the tool's place, its call's typed arguments, or None for the
        default call) -> text."""
        return _direct_render.remembered(key)

    @staticmethod
    def with_frozen(tools: Any, hints: Hints | None) -> Hints | None:
        """``hints`` knowing ``tools``' packing too when they are a ``FrozenTools``."""
        if not isinstance(tools, FrozenTools):
            return hints
        return tools.known(hints if isinstance(hints, KnownParts) else None)


def plain_tools(tools: Any) -> Any:
    """``tools`` as the plain computation takes them: a ``FrozenTools`` read back as a list."""
    return tools.unfrozen() if isinstance(tools, FrozenTools) else tools
