"""transformers' chat-template render of plain data, without the work whose result the key
already fixes.

``apply_chat_template(..., tokenize=False)`` normalizes the messages, puts the special tokens
and the kwargs in the template's variables, rebuilds every input out of plain JSON types
(``_plain_template_data``: a Python walk over the whole tools list) and renders its compiled
template (cached by transformers), whose ``tojson`` filter serializes each tool again on every
render (in pure Python when the template asks for ``indent``). Measured on 64 tools, these two
are most of a render (docs/benchmarks.md). When the cache has checked that ``tools`` and the
kwargs are exactly plain data (they are in the key):

- the rebuilt copy equals them and the immutable sandbox cannot change them, so they are
  rendered as given;
- ``tojson`` of one of the request's tools, with given arguments, is a function of that tool's
  content, which the key (and its independent check value) fixes: it is computed once per key
  and reused by later renders of the same key. The memo is keyed by the cache key, which holds
  the namespace, so tenants never share it (invariant 5), and is bounded in bytes.

The template is transformers' own source compiled in an overlay of transformers' own Jinja
environment (same sandbox, extensions, globals, filters), with only ``tojson`` wrapped.
Everything else goes through transformers' own steps, in its order.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from ..util.lru import ByteLRU
from .typed_keys import Unkeyable, typed_key

# Template variables that apply_chat_template would bind to its own parameters instead.
_UNSAFE_KWARGS = frozenset(("documents", "conversations", "messages"))
MEMO_BYTES = 64 << 20


@dataclass
class _Texts:
    """One key's tojson texts: by the tool's position for the default arguments (most
    templates' only call), by position and arguments for the rest."""

    plain: list[str | None]
    other: dict[tuple[Any, ...], str] = field(default_factory=dict)

    def size(self) -> int:
        texts = [t for t in self.plain if t is not None] + list(self.other.values())
        return sum(map(len, texts)) + 64 * len(texts)


@dataclass
class _Scope:
    """One render's view of its key's memo: which objects are the request's tools."""

    positions: dict[int, int]   # id(tool) -> its place in the request's tools
    texts: _Texts
    added: int = 0


_scope: ContextVar[_Scope | None] = ContextVar("prefix_cache_tojson_scope", default=None)


@dataclass
class TojsonMemo:
    """tojson texts per cache key (and check value), least recently used out (one per
    ``FastPromptText``, so per cache)."""

    lru: ByteLRU[tuple[str, int], _Texts] = field(default_factory=lambda: ByteLRU(MEMO_BYTES))
    lock: threading.Lock = field(default_factory=threading.Lock)

    def texts(self, key: tuple[str, int], n: int) -> _Texts:
        with self.lock:
            found = self.lru.get(key)
        return found if found is not None and len(found.plain) == n else _Texts([None] * n)

    def keep(self, key: tuple[str, int], texts: _Texts, added: int) -> None:
        if not added:
            return
        size = texts.size()  # C-level copies inside: other threads may be adding
        with self.lock:
            self.lru.put(key, texts, size)


    def remembered(self, key: str) -> dict[tuple[int, Any], str]:
        """The texts held for the cache key ``key`` (a read-only snapshot)."""
        with self.lock:
            found = [texts for (k, _), texts in self.lru.items() if k == key]
        out: dict[tuple[int, Any], str] = {}
        for texts in found:
            out.update({(i, None): t for i, t in enumerate(texts.plain) if t is not None})
            out.update({(at[0], at[1]): text for at, text in texts.other.items()})
        return out


class _Helpers:
    """The steps of transformers' ``apply_chat_template`` this render keeps."""

    def __init__(self) -> None:
        from transformers.utils import chat_template_utils as ctu

        self.compile = ctu._compile_jinja_template
        self.normalize = ctu._normalize_chat_messages
        self.plain = ctu._plain_template_data
        self.alias = ctu._alias_reasoning_fields


@lru_cache(maxsize=1)
def _helpers() -> _Helpers:
    return _Helpers()


def _remembering(tojson: Callable[..., str]) -> Callable[..., str]:
    """transformers' ``tojson``, reusing its text for the request's own tools."""

    def remembered(x: Any, ensure_ascii: bool = False, indent: Any = None,
                   separators: Any = None, sort_keys: bool = False) -> str:
        scope = _scope.get()
        if scope is None:
            return tojson(x, ensure_ascii, indent, separators, sort_keys)
        index = scope.positions.get(id(x))
        if index is None:  # not one of the request's tools
            return tojson(x, ensure_ascii, indent, separators, sort_keys)
        if ensure_ascii is False and indent is None and separators is None and sort_keys is False:
            text = scope.texts.plain[index]
            if text is None:
                text = scope.texts.plain[index] = tojson(x, ensure_ascii, indent, separators,
                                                         sort_keys)
                scope.added += 1
            return text
        try:  # typed: tojson(indent=2) and tojson(indent=2.0) are not one text (the second raises)
            at = (index, typed_key((ensure_ascii, indent, separators, sort_keys)))
        except Unkeyable:
            return tojson(x, ensure_ascii, indent, separators, sort_keys)
        found = scope.texts.other.get(at)
        if found is None:
            found = scope.texts.other[at] = tojson(x, ensure_ascii, indent, separators, sort_keys)
            scope.added += 1
        return found

    return remembered


def compiled(tokenizer: Any, template: str | None) -> Any:
    """``template`` compiled in an overlay of transformers' environment with a remembering
    ``tojson``, when ``tokenizer`` renders the base class's way; else None."""
    if template is None or not _base_method(tokenizer):
        return None
    try:
        env = _helpers().compile(template).environment.overlay()
        env.filters = {**env.filters, "tojson": _remembering(env.filters["tojson"])}
        return env.from_string(template)
    except Exception:  # another transformers layout, or a template that does not compile
        return None


def takes(tokenizer: Any, kwargs: Mapping[str, Any]) -> bool:
    """Whether this request renders the same way directly: the tokenizer's
    ``apply_chat_template`` is still the base class's (not replaced on the instance either) and
    no kwarg would bind to one of its parameters instead."""
    return not _UNSAFE_KWARGS.intersection(kwargs) and _base_method(tokenizer)


def _base_method(tokenizer: Any) -> bool:
    base = _base_apply()
    return base is not None and getattr(tokenizer.apply_chat_template, "__func__", None) is base


@lru_cache(maxsize=1)
def _base_apply() -> Any:
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
    except ImportError:  # pragma: no cover - another transformers layout
        return None
    return PreTrainedTokenizerBase.apply_chat_template


def render(template: Any, tokenizer: Any, messages: Sequence[Mapping[str, Any]],
           tools: Sequence[Mapping[str, Any]] | None, kwargs: Mapping[str, Any],
           memo: TojsonMemo | None = None, memo_key: tuple[str, int] | None = None,
           json_messages: bool = False) -> str:
    """The text of ``tokenizer.apply_chat_template(messages, tools, add_generation_prompt=True,
    tokenize=False, **kwargs)`` for plain ``tools`` and ``kwargs``; ``memo_key``: the cache key
    and check value those tools are the content of (their tojson texts are reused from and
    kept in ``memo``).
    ``json_messages``: every message is a dict of JSON values a parser made (nothing else in
    them), so transformers' two rebuilding walks over them would only copy them: its one other
    step, dropping the top-level keys whose value is None, is done here."""
    h = _helpers()
    if json_messages:
        chat = h.alias([{k: v for k, v in m.items() if v is not None} for m in messages])
    else:
        chat = h.alias(h.plain(h.normalize(list(messages))))
    variables = h.plain({**tokenizer.special_tokens_map, **kwargs})
    listed = None if tools is None else list(tools)
    scope = None
    if memo is not None and memo_key is not None and listed:
        scope = _Scope(dict(zip(map(id, listed), range(len(listed)), strict=True)),
                       memo.texts(memo_key, len(listed)))
    token = _scope.set(scope)
    try:
        text: str = template.render(messages=chat, tools=listed, documents=None,
                                    add_generation_prompt=True, **variables)
    finally:
        _scope.reset(token)
    if scope is not None and memo is not None and memo_key is not None:
        memo.keep(memo_key, scope.texts, scope.added)
    return text
