"""One nesting limit, one error, on both paths (issue 48): a value nested past
``keys.MAX_DEPTH`` levels in the tools, the kwargs or a static message's field is refused with
the same InvalidRequestError with the fast path on (the key packed in C, which nests 1024
levels) and off (the plain walk), at every nesting position, and one level less is answered
alike. Depths are counted from the field's value (the static messages, the tools list, the
kwargs object)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from prefix_cache import StaticPrefixCache
from prefix_cache.cache.keys import MAX_DEPTH
from prefix_cache.errors import InvalidRequestError, PrefixCacheError
from tests.support.templates import DEFAULT_SYSTEM

USER = {"role": "user", "content": "Hi"}
Request = tuple[list[dict[str, Any]], list[dict[str, Any]] | None, dict[str, Any] | None]


def _nest(levels: int, kind: type) -> Any:
    """A value whose innermost scalar is ``levels`` containers below it."""
    value: Any = 1
    for _ in range(levels):
        value = [value] if kind is list else {"k": value}
    return value


def _system(**fields: Any) -> dict[str, Any]:
    return {"role": "system", "content": "You are the agent.", **fields}


# Each position: where the value goes, and how many levels above it its field's value is.
POSITIONS: dict[str, tuple[int, Callable[[Any], Request]]] = {
    "a tool's parameters": (3, lambda v: (
        [_system(), USER], [{"type": "function", "function": {"name": "f", "parameters": v}}],
        None)),
    "a tool's own field": (2, lambda v: ([_system(), USER], [{"type": "function", "x": v}], None)),
    "a kwargs value": (1, lambda v: ([_system(), USER], None, {"x": v})),
    "a system message's field": (2, lambda v: ([_system(x=v), USER], None, None)),
    "a system content part's field": (4, lambda v: (
        [{"role": "system", "content": [{"type": "text", "text": "Be brief.", "x": v}]}, USER],
        None, None)),
    "a message of an all-static request": (2, lambda v: ([_system(x=v)], None, None)),
}


def _outcome(cache: StaticPrefixCache, tok: Any, request: Request) -> tuple[Any, ...]:
    messages, tools, kwargs = request
    try:
        result = cache.resolve(tok, messages, tools, kwargs, chat_template=DEFAULT_SYSTEM)
    except PrefixCacheError as exc:  # (a template may fail on a list content: alike on both)
        return ("refused", type(exc).__name__, str(exc))
    return ("answered", list(result.prompt_ids), result.specprefill_system_end)


@pytest.mark.parametrize("kind", [list, dict], ids=["lists", "objects"])
@pytest.mark.parametrize("position", list(POSITIONS))
def test_one_limit_one_error_on_both_paths(qwen3, position: str, kind: type) -> None:
    above, place = POSITIONS[position]
    caches = [StaticPrefixCache(fast_path=True), StaticPrefixCache(fast_path=False)]
    for deepest in (MAX_DEPTH, MAX_DEPTH + 1, 300, 520, 1100):
        request = place(_nest(deepest - above, kind))
        fast, plain = (_outcome(cache, qwen3, request) for cache in caches)
        assert fast == plain, deepest
        too_deep = fast[:2] == ("refused", "InvalidRequestError") and \
            f"nested more than {MAX_DEPTH} levels deep" in fast[2]
        assert too_deep == (deepest > MAX_DEPTH), deepest
        again = _outcome(caches[0], qwen3, request)  # a packing seen before: refused again
        assert again == fast, deepest


def test_a_deep_frozen_tool_list_is_refused_when_frozen() -> None:
    from prefix_cache.fastpath import FrozenTools

    with pytest.raises(InvalidRequestError, match=f"nested more than {MAX_DEPTH} levels"):
        FrozenTools([{"type": "function", "x": _nest(MAX_DEPTH, list)}])
