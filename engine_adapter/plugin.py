"""A plug-in for engines that compute ``specprefill_system_end`` themselves.

oMLX-style engines call ``self._inject_specprefill_system_end(messages, prompt, tools,
chat_template_kwargs, kwargs)`` after rendering a chat request, and read
``kwargs["specprefill_system_end"]``. Their own version subtracts a second render, which is wrong
on real templates (default system blocks, tools in the second render), and the vision-language
engine's copy even renders without the request's tools and chat_template_kwargs. This module
routes that computation through ``StaticPrefixCache`` instead: the two-probe boundary, with the
probe renders done once per distinct static prefix, per namespace.

    boundary = SpecPrefillBoundary(StaticPrefixCache(), namespace="tenant-42")
    install(engine, boundary)          # every oMLX engine shape: see ``omlx_hooks``

``install`` finds the engine's seam (``omlx_hooks``): oMLX's upstream
``_inject_specprefill_system_end`` where it exists, the inline subtraction in ``stream_chat``
(text and vision engines, flyto-mlx 0.7.0, fusion-mlx 0.10.24) where it does not, and raises
``OmlxShapeError`` naming the version and what is missing otherwise. There the boundary is
computed with ``aprompt`` on the engine's event loop (a miss renders in the cache's threads),
only when SpecPrefill is on for the model and the request.

Both engine shapes are handled:

- text engine: ``prompt`` is the rendered string. Its ids are not encoded again: the cache
  renders the same request (the same messages, tools and template kwargs) and tokenizes it
  from the stored static ids on (its prefix-aware tokenization, sampled-checked against a full
  one), and the tokens the tokenizer's defaults put in front (a Llama-3 BOS) are added, so the
  ids are ``tokenizer.encode(prompt)``, the ids oMLX prefills, and the boundary counts in them;
  ``aprompt`` hands those ids back for the scheduler. With the ``encode`` callable given, its
  ids are taken as the engine's instead;
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
from .omlx_hooks import OmlxShapeError, install_hooks
from prefix_cache.cache.cache import PrefixResult

__all__ = ["EnginePrompt", "OmlxShapeError", "SpecPrefillBoundary", "install"]

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


def _lead_ids(tokenizer: Any) -> list[int]:
    """The ids the tokenizer's defaults put before any text (a Llama-3 BOS; none for Qwen)."""
    return list(tokenizer.encode("a"))[:_leading_specials(tokenizer)]


@dataclass(frozen=True)
class EnginePrompt:
    """What the engine prefills: its ids (the lead ids the tokenizer's defaults add, then the
    render's) and the boundary in them (0: nothing to protect)."""

    ids: list[int]
    system_end: int


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
        self._leads: dict[int, tuple[Any, list[int]]] = {}  # id(tokenizer) -> its lead ids

    def __call__(self, messages: Sequence[Mapping[str, Any]], prompt: str | Sequence[int],
                 tools: Sequence[Mapping[str, Any]] | None,
                 chat_template_kwargs: Mapping[str, Any] | None, kwargs: dict[str, Any],
                 *, tokenizer: Any | None = None) -> None:
        """Set ``kwargs["specprefill_system_end"]`` (oMLX's ``_inject_...`` signature)."""
        call = self._prepare(messages, prompt, tools, chat_template_kwargs, kwargs, tokenizer)
        if call is not None:
            self._apply(_outcome(lambda: self.cache.resolve(*call.args, **call.options)),
                        call, kwargs)

    async def ainject(self, messages: Sequence[Mapping[str, Any]], prompt: str | Sequence[int],
                      tools: Sequence[Mapping[str, Any]] | None,
                      chat_template_kwargs: Mapping[str, Any] | None, kwargs: dict[str, Any],
                      *, tokenizer: Any | None = None) -> None:
        """The same for asyncio engines: renders on a miss run off the event loop."""
        await self.aprompt(messages, prompt, tools, chat_template_kwargs, kwargs,
                           tokenizer=tokenizer)

    async def aprompt(self, messages: Sequence[Mapping[str, Any]], prompt: str | Sequence[int],
                      tools: Sequence[Mapping[str, Any]] | None,
                      chat_template_kwargs: Mapping[str, Any] | None, kwargs: dict[str, Any],
                      *, tokenizer: Any | None = None, partial: bool = False
                      ) -> EnginePrompt | None:
        """``ainject``, and the engine's prompt ids with it (None: nothing was computed and
        ``kwargs`` holds no boundary). ``partial``: the prompt continues the final assistant
        message (rendered without a generation prompt), as oMLX's partial mode renders it."""
        call = self._prepare(messages, prompt, tools, chat_template_kwargs, kwargs, tokenizer,
                             partial)
        if call is None:
            return None
        outcome = await _aoutcome(self.cache.aresolve(*call.args, **call.options))
        return self._apply(outcome, call, kwargs)

    def _prepare(self, messages: Sequence[Mapping[str, Any]], prompt: str | Sequence[int],
                 tools: Sequence[Mapping[str, Any]] | None,
                 chat_template_kwargs: Mapping[str, Any] | None, kwargs: Mapping[str, Any],
                 tokenizer: Any | None, partial: bool = False) -> _Call | None:
        """The cache call this request makes (the same for ``resolve`` and ``aresolve``), or
        None where there is none to make (off, already given, or the ids cannot be had).

        The prompt's ids: given (the vision shape's ids, or the ``encode`` callable's), or,
        for a rendered string, left to the cache (its prefix-aware tokenization of the same
        render; no full encode of the prompt), behind the tokenizer's lead ids."""
        if kwargs.get("specprefill") is False or kwargs.get(KWARG) is not None:
            return None  # off for this request, or already given (by a sidecar in front)
        tok = tokenizer if tokenizer is not None else self.tokenizer
        if tok is None:
            log.warning("no tokenizer for specprefill_system_end; dense prefill")
            return None
        lead: list[int] = []
        ids: list[int] | None = None
        try:
            if isinstance(prompt, str) and self.encode is None:
                lead = self._lead(tok)
            elif isinstance(prompt, str):
                ids = list(self.encode(prompt))
            else:  # the vision-language shape: the engine's own ids, placeholders expanded
                ids = [int(t) for t in prompt]
            namespace = self.namespace(kwargs) if callable(self.namespace) else self.namespace
            args = (tok, list(messages), _listed(tools), _dict(chat_template_kwargs))
        except Exception as exc:
            log.warning("specprefill_system_end not computed, dense prefill: %s", exc)
            return None
        options: dict[str, Any] = {"prompt_ids": ids, "chat_template": self.chat_template,
                                   "namespace": namespace, "model": self.model}
        if partial:  # oMLX's partial mode: continue the final assistant message
            options.update(add_generation_prompt=False, continue_final_message=True)
        return _Call(args, options, lead)

    def _lead(self, tokenizer: Any) -> list[int]:
        known = self._leads.get(id(tokenizer))
        if known is None or known[0] is not tokenizer:  # (the tokenizer held: its id stays)
            known = (tokenizer, _lead_ids(tokenizer))
            self._leads[id(tokenizer)] = known
        return known[1]

    def _apply(self, outcome: PrefixResult | Exception, call: _Call,
               kwargs: dict[str, Any]) -> EnginePrompt | None:
        if isinstance(outcome, Exception):  # never fails the request: dense prefill
            log.warning("specprefill_system_end not computed, dense prefill: %s", outcome)
            return None
        self.last = outcome
        end = outcome.specprefill_system_end
        if end > 0:
            kwargs[KWARG] = len(call.lead) + end
        return EnginePrompt(call.lead + outcome.prompt_ids,
                            len(call.lead) + end if end > 0 else 0)


@dataclass(frozen=True)
class _Call:
    """One prepared cache call: its arguments, and the engine's ids ahead of the render's."""

    args: tuple[Any, ...]
    options: dict[str, Any]
    lead: list[int]


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
            tokenizer_attr: str = "_tokenizer") -> str:
    """Make ``engine`` compute ``specprefill_system_end`` with ``boundary``, with the engine's
    own tokenizer (``engine.<tokenizer_attr>``) unless the boundary was given one; returns the
    shape found (``omlx_hooks.shape``: "seam", "text", "vision", "seam-sync"), or raises
    ``OmlxShapeError`` naming the oMLX version and what was not found."""
    return install_hooks(engine, boundary, tokenizer_attr)
