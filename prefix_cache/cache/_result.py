"""The answer for one request (``PrefixResult``), and what a render of its prompt made."""

from __future__ import annotations

from dataclasses import dataclass

from ..util.token_ids import TokenIds

HIT, MISS, NONE = "hit", "miss", "none"


@dataclass(frozen=True, slots=True)
class PrefixResult:
    """The answer for one request."""

    specprefill_system_end: int
    prompt: TokenIds    # the prompt's ids, packed; ``prompt_ids`` makes the list on first use
    cache: str          # "hit", "miss", or "none" when there is no static part
    key: str            # "" when cache == "none", or when the render cannot be cached
    static_tokens: int = 0  # length of the template's static scaffold (>= the boundary)
    uncacheable: str | None = None  # why this render is never cached (a "miss" every time)

    @property
    def hit(self) -> bool:
        return self.cache == HIT

    @property
    def prompt_ids(self) -> list[int]:
        return self.prompt.ids

    @property
    def prompt_tokens(self) -> int:
        """How many ids the prompt has (without making their list)."""
        return len(self.prompt)


@dataclass(frozen=True, slots=True)
class RenderedText:
    """The request's rendered prompt, and whether it rendered with the tools=[] fallback."""

    text: str
    empty_tools: bool
