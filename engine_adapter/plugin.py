"""A plug-in for engines that compute ``specprefill_system_end`` themselves.

oMLX-style engines call ``self._inject_specprefill_system_end(messages, prompt, tools,
chat_template_kwargs, kwargs)`` after rendering a chat request, and read
``kwargs["specprefill_system_end"]``. Their own version subtracts a second render, which is wrong
on real templates (default system blocks, tools in the second render), and the vision-language
engine's copy even renders without the request's tools and chat_template_kwargs. This module
routes that computation through ``StaticPrefixCache`` instead: the two-probe boundary, with the
probe renders done once per distinct static prefix, per namespace.

    boundary = SpecPrefillBoundary(StaticPrefixCache(), namespace="tenant-42")
    install(engine, boundary)          # engine._inject_specprefill_system_end now uses it

Both engine shapes are handled:

- text engine: ``prompt`` is the rendered string; by default it is tokenized as oMLX prefills
  it, ``tokenizer.encode(prompt)`` with the tokenizer's defaults (a Llama-3 tokenizer adds a BOS
  before the template's own), and the boundary counts in those ids; or with the ``encode``
  callable given, whose ids are taken as the engine's;
- vision-language engine: ``prompt`` is the token ids the engine will prefill (image
  placeholders already expanded); they are used as they are. Messages may carry image content
  parts; the static prefix is rendered with the request's tools and chat_template_kwargs.

A failure never fails the request: ``kwargs`` is left without a boundary (dense prefill).
No mlx import here.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prefix_cache import StaticPrefixCache
from prefix_cache.cache.cache import PrefixResult

log = logging.getLogger("engine_adapter.plugin")

KWARG = "specprefill_system_end"

Namespace = str | Callable[[Mapping[str, Any]], str]
Encode = Callable[[str], Sequence[int]]


def _leading_specials(tokenizer: Any) -> int:
    """How many tokens the tokenizer's defaults put before any text (a BOS: 1; Qwen: 0)."""
    plain = list(tokenizer.encode("a", add_special_tokens=False))
    framed = list(tokenizer.encode("a"))
    for lead in range(len(framed) - len(plain) + 1):
        if framed[lead:lead + len(plain)] == plain:
            return lead
    raise ValueError("the tokenizer's default encode does not hold its plain encode")


def _encode_as_engine(tokenizer: Any, prompt: str) -> tuple[list[int], int]:
    """oMLX's prefill ids (``tokenizer.encode(prompt)``, the tokenizer's defaults) and how many
    of them the defaults put before the rendered text: the cache counts in the render's ids
    (the template writes its own BOS), the engine's boundary is that count further on."""
    return list(tokenizer.encode(prompt)), _leading_specials(tokenizer)


class SpecPrefillBoundary:
    """Computes an engine request's ``specprefill_system_end`` through a StaticPrefixCache."""

    def __init__(
        self,
        cache: StaticPrefixCache | None = None,
        *,
        tokenizer: Any | None = None,
        chat_template: str | None = None,
        namespace: Namespace = "default",
        model: str | None = None,
        encode: Encode | None = None,
    ) -> None:
        self.cache = cache if cache is not None else StaticPrefixCache()
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.namespace = namespace
        self.model = model
        self.encode = encode
        self.last: PrefixResult | None = None  # the latest result, for logs and tests

    def __call__(self, messages: Sequence[Mapping[str, Any]], prompt: str | Sequence[int],
                 tools: Sequence[Mapping[str, Any]] | None,
                 chat_template_kwargs: Mapping[str, Any] | None, kwargs: dict[str, Any],
                 *, tokenizer: Any | None = None) -> None:
        """Set ``kwargs["specprefill_system_end"]`` (oMLX's ``_inject_...`` signature)."""
        call = self._prepare(messages, prompt, tools, chat_template_kwargs, kwargs, tokenizer)
        if call is not None:
            self._apply(_outcome(lambda: self.cache.resolve(*call.args, **call.options)),
                        call.lead, kwargs)

    async def ainject(self, messages: Sequence[Mapping[str, Any]], prompt: str | Sequence[int],
                      tools: Sequence[Mapping[str, Any]] | None,
                      chat_template_kwargs: Mapping[str, Any] | None, kwargs: dict[str, Any],
                      *, tokenizer: Any | None = None) -> None:
        """The same for asyncio engines: renders on a miss run off the event loop."""
        call = self._prepare(messages, prompt, tools, chat_template_kwargs, kwargs, tokenizer)
        if call is not None:
            self._apply(await _aoutcome(self.cache.aresolve(*call.args, **call.options)),
                        call.lead, kwargs)

    def _prepare(self, messages: Sequence[Mapping[str, Any]], prompt: str | Sequence[int],
                 tools: Sequence[Mapping[str, Any]] | None,
                 chat_template_kwargs: Mapping[str, Any] | None, kwargs: Mapping[str, Any],
                 tokenizer: Any | None) -> _Call | None:
        """The cache call this request makes (the same for ``resolve`` and ``aresolve``), or
        None where there is none to make (off, already given, or the ids cannot be had)."""
        if kwargs.get("specprefill") is False or kwargs.get(KWARG) is not None:
            return None  # off for this request, or already given (by a sidecar in front)
        tok = tokenizer if tokenizer is not None else self.tokenizer
        if tok is None:
            log.warning("no tokenizer for specprefill_system_end; dense prefill")
            return None
        lead = 0
        try:
            if isinstance(prompt, str) and self.encode is None:
                ids, lead = _encode_as_engine(tok, prompt)
            elif isinstance(prompt, str):
                ids = list(self.encode(prompt))
            else:  # the vision-language shape: the engine's own ids, placeholders expanded
                ids = [int(t) for t in prompt]
            namespace = self.namespace(kwargs) if callable(self.namespace) else self.namespace
            args = (tok, list(messages), _listed(tools), _dict(chat_template_kwargs))
        except Exception as exc:
            log.warning("specprefill_system_end not computed, dense prefill: %s", exc)
            return None
        options = {"prompt_ids": ids[lead:], "chat_template": self.chat_template,
                   "namespace": namespace, "model": self.model}
        return _Call(args, options, lead)

    def _apply(self, outcome: PrefixResult | Exception, lead: int,
               kwargs: dict[str, Any]) -> None:
        if isinstance(outcome, Exception):  # never fails the request: dense prefill
            log.warning("specprefill_system_end not computed, dense prefill: %s", outcome)
            return
        self.last = outcome
        if outcome.specprefill_system_end > 0:
            kwargs[KWARG] = lead + outcome.specprefill_system_end


@dataclass(frozen=True)
class _Call:
    """One prepared cache call: its arguments, and the engine's ids ahead of the render's."""

    args: tuple[Any, ...]
    options: dict[str, Any]
    lead: int


def _outcome(resolve: Callable[[], PrefixResult]) -> PrefixResult | Exception:
    try:
        return resolve()
    except Exception as exc:  # handed to _apply: logged, and the request prefills densely
        return exc


async def _aoutcome(resolving: Awaitable[PrefixResult]) -> PrefixResult | Exception:
    try:
        return await resolving
    except Exception as exc:
        return exc


def _listed(tools: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]] | None:
    # [] stays []: the engine rendered with it, and templates tell it from None.
    return None if tools is None else [dict(t) for t in tools]


def _dict(kwargs: Mapping[str, Any] | None) -> dict[str, Any] | None:
    return dict(kwargs) if kwargs else None


def install(engine: Any, boundary: SpecPrefillBoundary, *,
            tokenizer_attr: str = "_tokenizer") -> None:
    """Make ``engine._inject_specprefill_system_end`` use ``boundary``, with the engine's own
    tokenizer (``engine.<tokenizer_attr>``) unless the boundary was given one."""

    def inject(messages: Sequence[Mapping[str, Any]], prompt: str | Sequence[int],
               template_tools: Sequence[Mapping[str, Any]] | None,
               ct_kwargs: Mapping[str, Any] | None, kwargs: dict[str, Any]) -> None:
        tok = boundary.tokenizer or getattr(engine, tokenizer_attr, None)
        boundary(messages, prompt, template_tools, ct_kwargs, kwargs, tokenizer=tok)

    engine._inject_specprefill_system_end = inject
