"""What the core asks of its accelerators (``prefix_cache.fastpath``): two narrow protocols.

- ``Hints``: what a request's body parse (or a frozen tool list) already worked out for some of
  the objects the request holds -- their key material packed, parser-made JSON. One value per
  request; it crosses from the body parser to the cache in ``PrefixRequest.hints``.
- ``FastPath``: the accelerators of one cache (the direct render and its
  ``tojson`` memo, the tail pieces). The core holds one, or None when the fast path is off
  (``PREFIX_CACHE_FAST_PATH=off``): then every step runs the plain computation.

They are declared here, in the core, because the accelerators are built on the core's key and
token modules (``fastpath`` imports ``keys``): the core names only these protocols, never the
package (``tests/test_architecture.py``). Nothing a hint or an accelerator says may change an
answer, only its cost: anything unknown is computed the plain way.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol


class Hints(Protocol):
    """What one request's parse already knows of the objects it made, found by identity."""

    def __bool__(self) -> bool:
        """Whether any part's key material is known."""

    def packed(self, value: Any) -> bytes | None:
        """``value``'s key material as ``keys.canonical_bytes`` packs that part, when known."""

    def all_json(self, values: Iterable[Any]) -> bool:
        """Whether every one of ``values`` is JSON data a parser made and nothing changed."""

    def frozen(self, tools: Any) -> bool:
        """Whether ``tools`` is a tool list checked and packed when it was frozen (each read
        of it is a fresh copy)."""


class FastPath(Protocol):
    """The accelerators of one cache, as the render, key and tokenization code ask them."""

    def compile_template(self, tokenizer: Any, template: str | None) -> Any:
        """``template`` compiled for ``render``, or None where it cannot render directly."""

    def renders_directly(self, tokenizer: Any, kwargs: Mapping[str, Any]) -> bool:
        """Whether this tokenizer and these kwargs may take the direct render."""

    def render(self, compiled: Any, tokenizer: Any, messages: Sequence[Mapping[str, Any]],
               tools: Sequence[Mapping[str, Any]] | None, kwargs: Mapping[str, Any],
               memo_key: tuple[str, int] | None, json_messages: bool) -> str:
        """The text ``apply_chat_template(..., tokenize=False)`` gives for plain data."""

    def tokenize_tail(self, renderer: Any, scope: str, text: str) -> list[int]:
        """``renderer.tokenize_tail(text)``, from ``scope``'s remembered pieces where it can."""
