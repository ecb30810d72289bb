"""Rendering conversations to token ids with the engine's own renderer, and the render's identity.

A ``TemplateRenderer`` is one (renderer, chat template) pair. The renderer is the object the
caller gave: a transformers tokenizer renders the transformers way (special tokens as template
variables, no extra BOS on tokenizing); an object with its own ``apply_chat_template`` (an mlx-lm
``TokenizerWrapper``) renders through that method, so whatever it adds (mlx-lm sets
``enable_thinking`` from the vocabulary and may use a Python renderer instead of Jinja) is in
the probes exactly as in the engine's prompt.

The identity digest that goes into cache keys covers everything that can change a render besides
the request: the tokenizer (its whole serialized backend, special tokens and every encode-time
setting), the template text or Python renderer, what a wrapper injects, and the transformers and
Jinja versions. It is the same in every process and on every machine, so replicas share entries.
The tokenizer's fingerprint (``tokenizer_identity.py``) is computed once and re-checked cheaply on
every call, so a tokenizer changed after first use (``add_tokens``) gets a new one.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import inspect
import logging
import sys
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import orjson
import xxhash

from ..errors import InvalidRequestError, NoChatTemplateError, TemplateRenderError
from ._template_clock import (
    DAY_FORMAT,
    NO_CLOCK,
    ClockUse,
    clock_use,
    randomness_seen,
    watch_randomness,
)
from .tokenizer_identity import TokenizerState, TokenizerStates
from .tokenizer_model import TokenizerModel

log = logging.getLogger("prefix_cache")

Messages = Sequence[Mapping[str, Any]]
Tools = Sequence[Mapping[str, Any]] | None


def unwrap_tokenizer(tokenizer: Any) -> Any:
    """The transformers tokenizer behind an mlx-lm ``TokenizerWrapper`` (or the tokenizer itself)."""
    inner = getattr(tokenizer, "_tokenizer", None)
    # A fast HF tokenizer also has ``_tokenizer`` (the Rust backend), which cannot render.
    if inner is not None and hasattr(inner, "apply_chat_template"):
        return inner
    return tokenizer


def tool_choices(tools: Tools) -> tuple[list[Mapping[str, Any]] | None, ...]:
    """The ``tools`` arguments to try, in order: the request's own, and for a request without
    tools, ``[]`` after ``None`` (Hermes and Command-R+ tool_use templates iterate ``tools``
    unguarded and fail on ``None``). This is the only substitution ever made."""
    if tools is None:
        return (None, [])
    return (list(tools),)


def with_choice(tools: Tools, render: Callable[[list[Mapping[str, Any]] | None], Any]
                ) -> tuple[Any, list[Mapping[str, Any]] | None]:
    """``render(choice)`` for the first of ``tool_choices(tools)`` that renders, and that
    choice; the last choice's TemplateRenderError when none does."""
    choices = tool_choices(tools)
    for choice in choices[:-1]:
        try:
            return render(choice), choice
        except TemplateRenderError:
            pass
    return render(choices[-1]), choices[-1]


@dataclass(frozen=True, slots=True)
class RenderOptions:
    """How a request's own prompt is rendered (``apply_chat_template``'s parameters of that
    name). The probes always render with the generation prompt, as the contract defines them;
    these change only the prompt, and the boundary is cut against that prompt."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False

    def __post_init__(self) -> None:
        if self.add_generation_prompt and self.continue_final_message:
            raise InvalidRequestError(
                "continue_final_message continues the final message, so it needs "
                "add_generation_prompt false", code="invalid_value")


DEFAULT_OPTIONS = RenderOptions()


# -- what a wrapper adds --------------------------------------------------------------------------


def python_renderer(tokenizer: Any, inner: Any = None) -> Callable[..., Any] | None:
    """The Python chat-template function an mlx-lm wrapper renders with (``chat_template_type``).
    ``inner``: the unwrapped tokenizer, when the caller has it already."""
    if (inner if inner is not None else unwrap_tokenizer(tokenizer)) is tokenizer:
        return None
    renderer = getattr(tokenizer, "_chat_template", None)
    return renderer if callable(renderer) else None


def wrapper_descriptor(tokenizer: Any) -> bytes:
    """What a wrapper with its own ``apply_chat_template`` adds to every render: its class and
    package version, the thinking variable it sets and to what, and its Python renderer."""
    kind = type(tokenizer)
    package = kind.__module__.split(".", 1)[0]
    parts: list[Any] = [kind.__module__, kind.__qualname__, _package_version(package),
                        getattr(tokenizer, "_thinking_kwarg", None),
                        _safe_bool(tokenizer, "has_thinking")]
    renderer = python_renderer(tokenizer)
    if renderer is not None:
        parts.append(_function_identity(renderer)[0])
    return orjson.dumps(parts, default=repr)


def _safe_bool(obj: Any, name: str) -> bool | None:
    try:
        return bool(getattr(obj, name))
    except Exception:  # a property that raises says nothing about the render
        return None


@lru_cache(maxsize=64)
def _package_version(package: str) -> str:
    try:
        return importlib.metadata.version(package.replace("_", "-"))
    except importlib.metadata.PackageNotFoundError:
        module = sys.modules.get(package)
        return str(getattr(module, "__version__", ""))


@lru_cache(maxsize=64)
def _function_identity(function: Callable[..., Any]) -> tuple[str, bool]:
    """(name and source digest, whether it may read the clock) of a Python renderer."""
    module = inspect.getmodule(function)
    try:
        source = inspect.getsource(module) if module is not None else inspect.getsource(function)
    except (OSError, TypeError):
        source = ""
    name = f"{getattr(function, '__module__', '')}.{getattr(function, '__qualname__', '')}"
    digest = hashlib.sha256(source.encode()).hexdigest()
    reads_clock = not source or any(word in source for word in ("datetime", "strftime", "time."))
    return f"{name}:{digest}", reads_clock


# -- the renderer ---------------------------------------------------------------------------------


class TemplateRenderer:
    """Renders one chat template through one renderer; cheap to call, safe from many threads."""

    def __init__(self, target: Any, template: str | None, identity: bytes,
                 clock: ClockUse = NO_CLOCK, tokenizer_digest: bytes = b"",
                 split_special_tokens: bool | None = None) -> None:
        self.target = target        # what renders: a tokenizer, or a wrapper with its own method
        self.tokenizer = unwrap_tokenizer(target)   # what tokenizes
        self.template = template    # None: the wrapper's Python renderer
        self.identity = identity
        self.clock = clock          # what the render reads from the clock (or randomness)
        self.tokenizer_digest = tokenizer_digest  # the tokenizer's fingerprint (its state)
        # The flag as the key read it (the fingerprint names it): every tokenization of this
        # renderer uses it, whatever the tokenizer's backend still holds from its last encode.
        self.split_special_tokens = bool(getattr(self.tokenizer, "split_special_tokens", False)
                                         if split_special_tokens is None else split_special_tokens)
        self._wrapped = self.tokenizer is not target
        # The tokenizer as the key read it (None for a wrapper's: it encodes its own way).
        self.tokenizer_model: TokenizerModel | None = None if self._wrapped else \
            TokenizerModel(self.tokenizer, self.split_special_tokens)
        self._backend = None if self.tokenizer_model is None else self.tokenizer_model.backend

    @property
    def uses_date(self) -> bool:
        return bool(self.clock.formats)

    @property
    def uncacheable(self) -> str | None:
        """Why this render cannot be reproduced by a later request (None: it can)."""
        return self.clock.uncacheable

    def date_tag(self) -> str | None:
        """What strftime_now prints now in the template's own formats (local time), for
        templates that read the clock: the key's time part."""
        return self.clock.tag()

    def apply(self, messages: Messages, tools: Tools, kwargs: Mapping[str, Any],
              options: RenderOptions = DEFAULT_OPTIONS) -> list[int]:
        """Token ids of the rendered conversation (with the generation prompt unless
        ``options`` say otherwise), ``tools`` exactly as given; TemplateRenderError with the
        template's own message if it raises."""
        try:
            out = self._call(list(messages), None if tools is None else list(tools), kwargs,
                             options=options)
            ids = out["input_ids"] if isinstance(out, Mapping) else out
            return list(ids)
        except Exception as exc:
            raise TemplateRenderError(template_message(exc)) from exc

    def render_text(self, messages: Messages, tools: Tools, kwargs: Mapping[str, Any],
                    options: RenderOptions = DEFAULT_OPTIONS) -> str:
        """The text ``apply`` tokenizes: the same call through the renderer's own
        ``apply_chat_template``, with ``tokenize=False``."""
        try:
            out = self._call(list(messages), None if tools is None else list(tools), kwargs,
                             tokenize=False, options=options)
        except Exception as exc:
            raise TemplateRenderError(template_message(exc)) from exc
        if not isinstance(out, str):
            raise TemplateRenderError(f"chat template error: the render is a {type(out).__name__}, "
                                      "not text")
        return out

    @property
    def wrapped(self) -> bool:
        """Whether the renderer is a wrapper with its own ``apply_chat_template``."""
        return self._wrapped

    @property
    def backend(self) -> Any:
        """The tokenizers backend ``tokenize`` would only wrap (``tokenize_tail`` calls it
        straight), or None."""
        return self._backend

    def tokenize_tail(self, text: str) -> list[int]:
        """``tokenize(text)`` for a hit's short tail: straight from the tokenizers backend when
        transformers' call would only wrap that same call (no truncation or padding set on it,
        special tokens not split): its wrapper costs more than the encoding of a short text.
        The sampled full check compares what this makes with ``tokenize``'s."""
        backend = self._backend
        if backend is None or backend.truncation is not None or backend.padding is not None \
                or backend.encode_special_tokens != self.split_special_tokens:
            return self.tokenize(text)
        try:
            return list(backend.encode(text, add_special_tokens=False).ids)
        except Exception as exc:
            _check_text(text)
            raise TemplateRenderError(f"tokenizer error: {exc}") from exc

    def tokenize(self, text: str) -> list[int]:
        """Token ids of rendered text exactly as ``apply`` makes them: transformers tokenizes a
        render with ``add_special_tokens=False`` (and no padding or truncation); mlx-lm encodes
        a Python renderer's text with ``encode(text, add_special_tokens=False)``."""
        try:
            if self._wrapped and self.template is None:
                return list(self.tokenizer.encode(text, add_special_tokens=False))
            # The key's flag, not the attribute as it is now (``split_special_tokens``).
            flags = {} if self._backend is None else \
                {"split_special_tokens": self.split_special_tokens}
            out = self.tokenizer(text, padding=False, truncation=False, max_length=None,
                                 add_special_tokens=False, return_tensors=None,
                                 sanitize_control_tokens=False, **flags)
            return list(out["input_ids"])
        except Exception as exc:
            _check_text(text)  # a lone surrogate in the request's own text is the client's fault
            raise TemplateRenderError(f"tokenizer error: {exc}") from exc

    def text_with_choice(self, messages: Messages, tools: Tools, kwargs: Mapping[str, Any],
                         options: RenderOptions = DEFAULT_OPTIONS
                         ) -> tuple[str, list[Mapping[str, Any]] | None]:
        """``render_text`` with the documented tools fallback, and the ``tools`` it rendered with."""
        return with_choice(tools, lambda choice: self.render_text(messages, choice, kwargs,
                                                                  options))

    def render_ids(self, messages: Messages, tools: Tools, kwargs: Mapping[str, Any],
                   options: RenderOptions = DEFAULT_OPTIONS) -> list[int]:
        """``apply`` with the documented fallback: no tools that fail as None render as ``[]``."""
        return self.render_with_choice(messages, tools, kwargs, options)[0]

    def render_with_choice(self, messages: Messages, tools: Tools, kwargs: Mapping[str, Any],
                           options: RenderOptions = DEFAULT_OPTIONS
                           ) -> tuple[list[int], list[Mapping[str, Any]] | None]:
        """``render_ids`` and the ``tools`` argument it rendered with."""
        return with_choice(tools, lambda choice: self.apply(messages, choice, kwargs, options))

    def _call(self, messages: list[Mapping[str, Any]], tools: list | None,
              kwargs: Mapping[str, Any], tokenize: bool = True,
              options: RenderOptions = DEFAULT_OPTIONS) -> Any:
        if self.template is not None:  # transformers' environment may have been made again
            _watch_template(self.template)
        with randomness_seen() as drawn:
            try:
                return self._render_call(messages, tools, kwargs, tokenize, options)
            finally:
                if drawn:
                    self.drew(drawn[0])

    def drew(self, why: str) -> None:
        """A render drew at random: this renderer's renders are never cached from now on."""
        if self.clock.uncacheable is None:
            self.clock = ClockUse(self.clock.formats, why)
            log.warning("chat template renders at random (%s): not cached", why)

    def _render_call(self, messages: list[Mapping[str, Any]], tools: list | None,
                     kwargs: Mapping[str, Any], tokenize: bool,
                     options: RenderOptions) -> Any:
        flags: dict[str, Any] = {"add_generation_prompt": options.add_generation_prompt}
        if options.continue_final_message:  # only when asked: Python renderers may not take it
            flags["continue_final_message"] = True
        if not self._wrapped:
            return self.target.apply_chat_template(
                messages, tools=tools, chat_template=self.template, tokenize=tokenize,
                return_dict=False, **flags, **kwargs)
        if self.template is None:  # a Python renderer takes no template text
            return self.target.apply_chat_template(
                messages, tools=tools, tokenize=tokenize, **flags, **kwargs)
        return self.target.apply_chat_template(
            messages, tools=tools, chat_template=self.template, tokenize=tokenize, **flags,
            **kwargs)


def _check_text(text: str) -> None:
    """InvalidRequestError if ``text`` is not Unicode text (it holds a lone surrogate)."""
    try:
        text.encode()
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(f"the prompt is not Unicode text: a lone surrogate "
                                  f"({exc.object[exc.start:exc.end]!r})") from None


def template_message(exc: Exception) -> str:
    message = str(exc).strip() or type(exc).__name__
    return f"chat template error: {message}"


# -- memo: the renderers of one owner ----------------------------------------------------------

MAX_TEMPLATES_PER_TOKENIZER = 256


class Renderers:
    """One owner's renderers (a cache's, or the process default of ``get_renderer``): per
    tokenizer or wrapper (weakly held), one ``TemplateRenderer`` per (tokenizer state, wrapper,
    template), and the tokenizer states they were made for."""

    def __init__(self, states: TokenizerStates | None = None) -> None:
        self.states = states if states is not None else TokenizerStates()
        self._table: weakref.WeakKeyDictionary[
            Any, dict[tuple[bytes, bytes, str], TemplateRenderer]] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def get(self, tokenizer: Any, chat_template: str | None = None,
            tools: Tools = None) -> TemplateRenderer:
        """The renderer for this tokenizer (or wrapper) and template (the tokenizer's own when
        none is given), for the tokenizer's state as it is now.

        ``chat_template`` may be template text or the name of one of the tokenizer's templates;
        with several named templates, requests with tools (``[]`` included) get ``tool_use`` if
        present, as in transformers."""
        inner = unwrap_tokenizer(tokenizer)
        function = python_renderer(tokenizer, inner)
        template, template_id = _template(inner, function, chat_template, tools)
        state = self.states.state(inner)  # read once: the key and the renderer share it
        descriptor = wrapper_descriptor(tokenizer) if inner is not tokenizer else b""
        memo_key = (state.fingerprint, descriptor, template_id)
        table = self._table.get(tokenizer)
        renderer = table.get(memo_key) if table is not None else None
        if renderer is None:
            renderer = _new_renderer(tokenizer, template, function, memo_key, state)
            with self._lock:
                table = self._table.setdefault(tokenizer, {})
                if len(table) >= MAX_TEMPLATES_PER_TOKENIZER:
                    # Per-request templates could grow this without end; the oldest is dropped.
                    table.pop(next(iter(table)))
                renderer = table.setdefault(memo_key, renderer)
        return renderer


_default: Renderers | None = None


def default_renderers() -> Renderers:
    """The process default ``Renderers``, for callers that own no cache (the engine's own
    renders, tools, benchmarks); a cache owns its own."""
    global _default
    if _default is None:
        _default = Renderers()
    return _default


def get_renderer(tokenizer: Any, chat_template: str | None = None,
                 tools: Tools = None) -> TemplateRenderer:
    """``Renderers.get`` of the process default (``default_renderers``)."""
    return default_renderers().get(tokenizer, chat_template, tools)


def _template(inner: Any, function: Callable[..., Any] | None, chat_template: str | None,
              tools: Tools) -> tuple[str | None, str]:
    """The template text (None for a Python renderer) and what identifies it."""
    if function is not None:
        if chat_template is not None:
            raise InvalidRequestError(
                "this tokenizer renders with mlx-lm's Python chat template "
                f"({getattr(function, '__module__', '?')}); a chat_template cannot be given")
        return None, _function_identity(function)[0]
    try:
        # transformers only asks whether tools is None: [] picks tool_use too.
        template = inner.get_chat_template(chat_template, tools)
    except ValueError as exc:
        raise NoChatTemplateError(str(exc)) from exc
    if not template:
        raise NoChatTemplateError("the tokenizer has no chat template and none was given")
    return template, template


def _new_renderer(tokenizer: Any, template: str | None, function: Callable[..., Any] | None,
                  memo_key: tuple[bytes, bytes, str], state: TokenizerState) -> TemplateRenderer:
    digest, descriptor, template_id = memo_key
    identity = xxhash.xxh3_128_digest(b"".join(
        len(part).to_bytes(4, "little") + part for part in (digest, descriptor, template_id.encode())))
    if function is not None:  # a Python renderer's clock is keyed by the day
        clock = ClockUse((DAY_FORMAT,)) if _function_identity(function)[1] else NO_CLOCK
    else:
        _watch_template(template or "")  # before the direct render copies its filters
        clock = _template_clock(template or "")
    return TemplateRenderer(tokenizer, template, identity, clock, digest,
                            state.split_special_tokens)


def _template_clock(template: str) -> ClockUse:
    """How a Jinja template reads the clock or randomness, parsed in transformers' own
    environment (its globals and extensions); a template naming none of them has no clock."""
    if not any(word in template for word in ("strftime_now", "random", "lipsum")):
        return NO_CLOCK
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        environment = _compile_jinja_template(template).environment
    except Exception:  # does not compile: its render fails with the template's own message
        return NO_CLOCK
    return clock_use(environment, template)


def _watch_template(template: str) -> None:
    """Randomness in transformers' environment of ``template`` recorded when drawn."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        watch_randomness(_compile_jinja_template(template).environment)
    except Exception:  # does not compile: its render fails with the template's own message
        return
