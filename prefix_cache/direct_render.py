"""transformers' chat-template render of plain data, without its defensive copy of the inputs.

``apply_chat_template(..., tokenize=False)`` normalizes the messages, puts the special tokens
and the kwargs in the template's variables, rebuilds every input out of plain JSON types
(``_plain_template_data``: a Python walk over the whole tools list, the largest cost of a render
on many tools) and renders its compiled template (cached by transformers). When the cache has
already checked that ``tools`` and the kwargs are exactly plain data (they are in the key), the
rebuilt copy equals them and the immutable sandbox cannot change them: rendering them as given
makes the same text. Everything else goes through transformers' own steps, in its order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any

# Template variables that apply_chat_template would bind to its own parameters instead.
_UNSAFE_KWARGS = frozenset(("documents", "conversations", "messages"))


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


def compiled(tokenizer: Any, template: str | None) -> Any:
    """transformers' compiled ``template`` when ``tokenizer`` renders the base class's way,
    else None."""
    if template is None or not _base_method(tokenizer):
        return None
    try:
        return _helpers().compile(template)
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
           tools: Sequence[Mapping[str, Any]] | None, kwargs: Mapping[str, Any]) -> str:
    """The text of ``tokenizer.apply_chat_template(messages, tools, add_generation_prompt=True,
    tokenize=False, **kwargs)`` for plain ``tools`` and ``kwargs``."""
    h = _helpers()
    chat = h.alias(h.plain(h.normalize(list(messages))))
    variables = h.plain({**tokenizer.special_tokens_map, **kwargs})
    text: str = template.render(messages=chat, tools=None if tools is None else list(tools),
                                documents=None, add_generation_prompt=True, **variables)
    return text
