"""Where ``install`` hooks a ``SpecPrefillBoundary`` into an oMLX engine, without a copy of oMLX's
method bodies.

Rule: the boundary is computed where the request is handed to the scheduler (the engine's
``stream_generate`` and ``generate``, asyncio), from what the engine rendered (recorded by a
wrapper of its render method), and only when SpecPrefill is on for the model
(``model_settings.specprefill_enabled``) and the request (``specprefill`` not False). The
engine's own subtraction is kept from running where it can be: its seam is replaced, or its
inline second render is recognized and refused (oMLX catches the error and sets nothing).

    text engine (BatchedEngine)                  vision engine (VLMBatchedEngine)
    _apply_chat_template  -> record the render   _process_chat_messages -> record (ids)
    _inject_specprefill_system_end (upstream)    inline: its second render is its tokenizer's
      -> replaced: nothing                         own; it runs, and its value is replaced
    inline: the second _apply_chat_template
      (the non-system messages) -> refused
    stream_generate / generate: the render found by the prompt's identity -> ``aprompt``:
      the boundary, and for a text prompt its ids, handed to the scheduler in place of the
      string (oMLX's scheduler takes ids and does not encode them again)

No mlx or omlx import here.
"""

from __future__ import annotations

import functools
import inspect
import logging
import re
import sys
import threading
from collections import OrderedDict
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol


class Boundary(Protocol):
    """What the hooks need of ``plugin.SpecPrefillBoundary`` (the plug-in imports this module)."""

    tokenizer: Any

    def __call__(self, messages: Any, prompt: Any, tools: Any, chat_template_kwargs: Any,
                 kwargs: dict[str, Any], *, tokenizer: Any | None = None) -> None: ...

    async def aprompt(self, messages: Any, prompt: Any, tools: Any, chat_template_kwargs: Any,
                      kwargs: dict[str, Any], *, tokenizer: Any | None = None,
                      partial: bool = False) -> Any: ...

log = logging.getLogger("engine_adapter.plugin")

SEAM = "_inject_specprefill_system_end"   # oMLX upstream's own seam
TEXT_RENDER = "_apply_chat_template"      # BatchedEngine: messages -> prompt string
VISION_RENDER = "_process_chat_messages"  # VLMBatchedEngine: messages -> (ids, embeds, ...)
SENDS = ("stream_generate", "generate")   # where a request goes to the scheduler
KWARG = "specprefill_system_end"
INLINE = re.compile(r"""\[["']specprefill_system_end["']\]\s*=""")  # stream_chat subtracts
PENDING = 256  # renders waiting for their send (a render never sent, e.g. a token count, ages out)


class OmlxShapeError(TypeError):
    """The engine has neither oMLX's seam nor the inline computation ``install`` hooks."""


@dataclass(frozen=True)
class Render:
    """One chat render of the engine: what the cache needs to render it again."""

    messages: list[Any]
    tools: Any
    chat_template_kwargs: dict[str, Any] | None
    partial: bool


class _Pending:
    """Renders waiting for their send, found by the identity of the prompt they returned."""

    def __init__(self) -> None:
        self._renders: OrderedDict[int, tuple[Any, Render]] = OrderedDict()
        self._lock = threading.Lock()  # the vision render runs on oMLX's MLX thread

    def add(self, prompt: Any, render: Render) -> None:
        with self._lock:
            self._renders[id(prompt)] = (prompt, render)
            while len(self._renders) > PENDING:
                self._renders.popitem(last=False)

    def last(self) -> Render | None:
        with self._lock:
            return next(reversed(self._renders.values()))[1] if self._renders else None

    def pop(self, prompt: Any) -> Render | None:
        with self._lock:
            held = self._renders.pop(id(prompt), None)
        return held[1] if held is not None and held[0] is prompt else None


class _Refused(RuntimeError):
    """Raised into oMLX's inline subtraction, which catches it and sets no boundary."""


def omlx_version(engine: Any) -> str:
    """The installed distribution and version the engine (or engine class) comes from."""
    from importlib import metadata

    kind = engine if isinstance(engine, type) else type(engine)
    root = kind.__module__.split(".")[0]
    for dist in metadata.packages_distributions().get(root, []):
        try:
            return f"{dist} {metadata.version(dist)}"
        except metadata.PackageNotFoundError:
            continue
    version = getattr(sys.modules.get(root), "__version__", None)
    return f"{root} {version or '(version unknown)'}"


def _source(method: Any) -> str:
    try:
        return inspect.getsource(method)
    except (OSError, TypeError):
        return ""


def shape(engine: Any) -> str:
    """Which of oMLX's shapes the engine has, the first that fits: "seam" (upstream's seam,
    async sends), "vision" / "text" (a render method, and a ``stream_generate`` that hands
    ``specprefill_system_end`` to the scheduler: flyto-mlx 0.7.0 and fusion-mlx 0.10.24, whose
    ``stream_chat`` subtracts inline, or not at all: fusion's vision engine), "seam-sync" (the
    seam and no async send: the seam computes, blocking); OmlxShapeError naming the version
    and what is missing otherwise."""
    kind = type(engine)
    has = {name: callable(getattr(kind, name, None))
           for name in (SEAM, TEXT_RENDER, VISION_RENDER, *SENDS)}
    sends = all(has[name] for name in SENDS)
    if has[SEAM] and sends and (has[VISION_RENDER] or has[TEXT_RENDER]):
        return "seam"
    forwards = sends and KWARG in _source(getattr(kind, "stream_generate"))
    if forwards and has[VISION_RENDER]:
        return "vision"
    if forwards and has[TEXT_RENDER]:
        return "text"
    if has[SEAM]:
        return "seam-sync"
    missing = [f"{SEAM}()"]
    missing += [f"{name}()" for name in SENDS if not has[name]]
    if sends and not forwards:
        missing.append(f"a stream_generate() that hands {KWARG} to the scheduler")
    if not (has[VISION_RENDER] or has[TEXT_RENDER]):
        missing.append(f"{TEXT_RENDER}() or {VISION_RENDER}()")
    raise OmlxShapeError(
        f"install: {kind.__module__}.{kind.__qualname__} ({omlx_version(engine)}) is not an "
        f"oMLX engine shape this plug-in knows: not found: {', '.join(missing)}; the "
        f"boundary would not reach the scheduler, so nothing was installed")


def specprefill_on(engine: Any, kwargs: Mapping[str, Any]) -> bool:
    """oMLX's own rule: on for the model's settings (an engine without model settings: on),
    and not turned off by the request."""
    if kwargs.get("specprefill") is False:
        return False
    if not hasattr(engine, "_model_settings"):
        return True
    return bool(getattr(engine._model_settings, "specprefill_enabled", False))


def _template_kwargs(engine: Any, given: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The kwargs oMLX's render passes the template: its global enable_thinking, overridden
    by the request's."""
    merged: dict[str, Any] = {}
    thinking = getattr(engine, "_enable_thinking", None)
    if thinking is not None:
        merged["enable_thinking"] = thinking
    merged.update(given or {})
    return merged or None


def unwrapped(tokenizer: Any, kwargs: dict[str, Any] | None
              ) -> tuple[Any, dict[str, Any] | None]:
    """mlx-lm's ``TokenizerWrapper`` (what oMLX holds) as the transformers tokenizer inside it,
    with what its ``apply_chat_template`` adds (``enable_thinking``, defaulted to its
    ``has_thinking``): the same render, and the cache renders a bare tokenizer's template
    directly, the static part reused (through the wrapper, every hit re-rendered all of it).
    A wrapper with its own template callable is kept as it is."""
    inner = getattr(tokenizer, "_tokenizer", None)
    if inner is None or not type(tokenizer).__module__.startswith("mlx_lm") or \
            getattr(tokenizer, "_chat_template", None) is not None or \
            not type(inner).__module__.startswith("transformers"):
        return tokenizer, kwargs
    merged = dict(kwargs or {})
    merged.setdefault("enable_thinking", getattr(tokenizer, "has_thinking", False))
    return inner, merged


def _partial(messages: list[Any]) -> bool:
    """oMLX's partial mode, as its render detects it when the server did not say."""
    return bool(messages) and isinstance(messages[-1], Mapping) and \
        messages[-1].get("role") == "assistant" and bool(messages[-1].get("partial", False))


def _is_subtraction(messages: Any, last: Render | None) -> bool:
    """The inline subtraction's second render: the last render's non-system messages, the
    very same objects, fewer of them."""
    if last is None or not isinstance(messages, list) or len(messages) >= len(last.messages):
        return False
    rest = [m for m in last.messages
            if not (isinstance(m, Mapping) and m.get("role") in ("system", "developer"))]
    return len(rest) == len(messages) and all(a is b for a, b in zip(rest, messages))


def install_hooks(engine: Any, boundary: Boundary, tokenizer_attr: str) -> str:
    """Hook ``boundary`` into ``engine`` (its instance attributes only); the shape found."""
    found = shape(engine)
    pending = _Pending()
    inline = found == "text" and \
        INLINE.search(_source(getattr(type(engine), "stream_chat", None))) is not None

    def tokenizer() -> Any:
        return boundary.tokenizer or getattr(engine, tokenizer_attr, None)

    if found == "seam-sync":
        def inject(messages: Any, prompt: Any, template_tools: Any, ct_kwargs: Any,
                   kwargs: dict[str, Any]) -> None:
            if specprefill_on(engine, kwargs):
                boundary(messages, prompt, template_tools, ct_kwargs, kwargs,
                         tokenizer=tokenizer())

        setattr(engine, SEAM, inject)
        return found
    if callable(getattr(type(engine), VISION_RENDER, None)):
        process = getattr(engine, VISION_RENDER)

        @functools.wraps(process)
        def vision_render(messages: Any, tools: Any, kwargs: dict[str, Any]) -> Any:
            out = process(messages, tools, kwargs)
            pending.add(out[0], Render(list(messages), tools, _template_kwargs(
                engine, kwargs.get("chat_template_kwargs")), False))
            return out

        setattr(engine, VISION_RENDER, vision_render)
    else:
        render = getattr(engine, TEXT_RENDER)

        @functools.wraps(render)
        def text_render(messages: Any, tools: Any = None, chat_template_kwargs: Any = None,
                        is_partial: bool | None = None) -> Any:
            if inline and _is_subtraction(messages, pending.last()):
                raise _Refused("the plug-in computes specprefill_system_end")
            partial = _partial(messages) if is_partial is None else bool(is_partial)
            prompt = render(messages, tools, chat_template_kwargs=chat_template_kwargs,
                            is_partial=is_partial)
            pending.add(prompt, Render(list(messages), tools,
                                       _template_kwargs(engine, chat_template_kwargs), partial))
            return prompt

        setattr(engine, TEXT_RENDER, text_render)
    if found == "seam":
        setattr(engine, SEAM, lambda *args, **kwargs: None)  # computed at the send

    async def prepared(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        """The send's arguments with the boundary in ``kwargs`` (and a text prompt's ids)."""
        prompt = kwargs["prompt"] if "prompt" in kwargs else (args[0] if args else None)
        held = pending.pop(prompt)
        if held is None:
            return args  # not a chat render of this engine (a plain completion)
        if not specprefill_on(engine, kwargs):
            return args  # SpecPrefill off: nothing computed
        kwargs.pop(KWARG, None)  # the engine's own (vision) subtraction: replaced
        tok, template_kwargs = unwrapped(tokenizer(), held.chat_template_kwargs)
        got = await boundary.aprompt(held.messages, prompt, held.tools, template_kwargs, kwargs,
                                     tokenizer=tok, partial=held.partial)
        if got is None or not isinstance(prompt, str):
            return args
        if "prompt" in kwargs:  # the ids, so oMLX's scheduler does not encode the prompt
            kwargs["prompt"] = got.ids
            return args
        return (got.ids, *args[1:])

    stream = getattr(engine, "stream_generate")
    generate = getattr(engine, "generate")

    @functools.wraps(stream)
    async def stream_generate(*args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        args = await prepared(args, kwargs)
        async for output in stream(*args, **kwargs):
            yield output

    @functools.wraps(generate)
    async def generate_once(*args: Any, **kwargs: Any) -> Any:
        args = await prepared(args, kwargs)
        return await generate(*args, **kwargs)

    engine.stream_generate = stream_generate
    engine.generate = generate_once
    return found
