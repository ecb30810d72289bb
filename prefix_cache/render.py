"""Rendering conversations to token ids exactly as transformers does, plus the render's identity.

A ``TemplateRenderer`` is one (tokenizer, chat template) pair. It renders with the transformers
convention (special tokens as template variables, no extra BOS on tokenizing), knows its identity
digest for cache keys (same in every process and on every machine, so replicas share entries),
whether the template reads today's date, and whether it needs ``tools=[]`` instead of ``None``.
Renderers are memoized per tokenizer object, so the fingerprint is computed once per tokenizer.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import orjson
import xxhash

from .errors import NoChatTemplateError, TemplateRenderError


def unwrap_tokenizer(tokenizer: Any) -> Any:
    """The transformers tokenizer behind an mlx-lm ``TokenizerWrapper`` (or the tokenizer itself)."""
    inner = getattr(tokenizer, "_tokenizer", None)
    # A fast HF tokenizer also has ``_tokenizer`` (the Rust backend), which cannot render.
    if inner is not None and hasattr(inner, "apply_chat_template"):
        return inner
    return tokenizer


def tokenizer_fingerprint(tokenizer: Any) -> bytes:
    """Stable digest of what can change how this tokenizer renders and tokenizes.

    Covers the tokenizer class, its full serialized backend (vocab, merges, normalizer,
    pre-tokenizer, added tokens), the special-token strings templates see as variables, and the
    transformers and Jinja versions (the render engine).
    """
    import jinja2
    import transformers

    h = xxhash.xxh3_128()
    for part in (
        type(tokenizer).__qualname__,
        transformers.__version__,
        jinja2.__version__,
    ):
        h.update(part.encode() + b"\x00")
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:  # slow tokenizer: vocab and added tokens are what it encodes with
        h.update(orjson.dumps(sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])))
    h.update(b"\x00")
    h.update(orjson.dumps(tokenizer.special_tokens_map, default=str))
    return h.digest()


class TemplateRenderer:
    """Renders one chat template with one tokenizer; cheap to call, safe from many threads."""

    def __init__(self, tokenizer: Any, template: str, tokenizer_digest: bytes) -> None:
        self.tokenizer = tokenizer
        self.template = template
        self.identity = xxhash.xxh3_128_digest(tokenizer_digest + template.encode())
        # transformers exposes strftime_now to templates; those that call it render today's date.
        self.uses_date = "strftime_now" in template
        self._empty_tools = False  # learned: this template fails on tools=None but not on []

    def date_tag(self) -> str | None:
        """Today's date as strftime_now would see it (local time), for templates that read it."""
        return datetime.now().strftime("%Y-%m-%d") if self.uses_date else None

    def _apply(self, messages: Sequence[Mapping[str, Any]], tools: list | None,
               kwargs: Mapping[str, Any]) -> list[int]:
        ids = self.tokenizer.apply_chat_template(
            list(messages),
            tools=tools,
            chat_template=self.template,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
            **kwargs,
        )
        return list(ids)

    def render_ids(self, messages: Sequence[Mapping[str, Any]],
                   tools: Sequence[Mapping[str, Any]] | None,
                   kwargs: Mapping[str, Any]) -> list[int]:
        """Token ids of the rendered conversation, with the generation prompt.

        Some templates (Hermes tool_use, Command-R+) iterate ``tools`` unguarded and fail on None;
        with no tools they are retried once with ``[]``, and the template remembers that.
        """
        tools_arg: list | None = list(tools) if tools else ([] if self._empty_tools else None)
        try:
            return self._apply(messages, tools_arg, kwargs)
        except Exception as exc:
            if tools_arg is None:
                try:
                    ids = self._apply(messages, [], kwargs)
                except Exception:
                    pass
                else:
                    self._empty_tools = True
                    return ids
            raise TemplateRenderError(_template_message(exc)) from exc


def _template_message(exc: Exception) -> str:
    message = str(exc).strip() or type(exc).__name__
    return f"chat template error: {message}"


class _TokenizerRecord:
    """Per-tokenizer memo: its fingerprint and one renderer per template text."""

    def __init__(self, tokenizer: Any) -> None:
        self.digest = tokenizer_fingerprint(tokenizer)
        self.renderers: dict[str, TemplateRenderer] = {}


MAX_TEMPLATES_PER_TOKENIZER = 256

_records: weakref.WeakKeyDictionary[Any, _TokenizerRecord] = weakref.WeakKeyDictionary()
_records_lock = threading.Lock()


def get_renderer(tokenizer: Any, chat_template: str | None = None,
                 tools: Sequence[Any] | None = None) -> TemplateRenderer:
    """The renderer for this tokenizer and template (the tokenizer's own when none is given).

    ``chat_template`` may be template text or the name of one of the tokenizer's templates; with
    several named templates, requests with tools get ``tool_use`` if present, as in transformers.
    """
    tokenizer = unwrap_tokenizer(tokenizer)
    try:
        template = tokenizer.get_chat_template(chat_template, list(tools) if tools else None)
    except ValueError as exc:
        raise NoChatTemplateError(str(exc)) from exc
    if not template:
        raise NoChatTemplateError("the tokenizer has no chat template and none was given")
    record = _records.get(tokenizer)
    if record is None:
        with _records_lock:  # fingerprinting a large vocab takes a while: do it once per tokenizer
            record = _records.get(tokenizer)
            if record is None:
                record = _records[tokenizer] = _TokenizerRecord(tokenizer)
    renderer = record.renderers.get(template)
    if renderer is None:
        with _records_lock:
            if len(record.renderers) >= MAX_TEMPLATES_PER_TOKENIZER:
                # Per-request templates could grow this without end; the oldest is dropped.
                record.renderers.pop(next(iter(record.renderers)))
            renderer = record.renderers.setdefault(
                template, TemplateRenderer(tokenizer, template, record.digest)
            )
    return renderer
