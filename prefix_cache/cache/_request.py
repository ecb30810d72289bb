"""One request to the cache, as one value (``resolve`` and ``aresolve`` build it from their
arguments), and the I/O steps its decision sequence asks its driver for."""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypedDict, Unpack

from ..util.hints import Hints
from ..render.render import DEFAULT_OPTIONS, RenderOptions
from ..util.token_ids import TokenIds


@dataclass(frozen=True, slots=True)
class PrefixRequest:
    """What ``resolve``/``aresolve`` were asked (their arguments, unchecked)."""

    tokenizer: Any
    messages: Sequence[Mapping[str, Any]]
    tools: Sequence[Mapping[str, Any]] | None = None
    chat_template_kwargs: Mapping[str, Any] | None = None
    prompt_ids: Sequence[int] | TokenIds | None = None
    chat_template: str | None = None
    namespace: str = "default"
    model: str | None = None
    options: RenderOptions = DEFAULT_OPTIONS
    hints: Hints | None = None  # what the body's parse (or frozen tools) already packed


class RequestOptions(TypedDict, total=False):
    """``resolve``'s and ``aresolve``'s keyword-only arguments (see ``PrefixRequest``)."""

    prompt_ids: Sequence[int] | TokenIds | None
    chat_template: str | None
    namespace: str
    model: str | None
    add_generation_prompt: bool
    continue_final_message: bool
    hints: Hints | None


def prefix_request(tokenizer: Any, messages: Sequence[Mapping[str, Any]],
                   tools: Sequence[Mapping[str, Any]] | None,
                   chat_template_kwargs: Mapping[str, Any] | None,
                   **options: Unpack[RequestOptions]) -> PrefixRequest:
    """The one value of ``resolve``'s arguments (TypeError for an argument it does not take)."""
    render = RenderOptions(options.pop("add_generation_prompt", True),
                           options.pop("continue_final_message", False))
    return PrefixRequest(tokenizer, messages, tools, chat_template_kwargs, options=render,
                         **options)


@dataclass(frozen=True, slots=True)
class Lookup:
    """Read the store under ``key`` (a miss when it is down)."""

    key: str


@dataclass(frozen=True, slots=True)
class Work:
    """Run ``function(*args)``: renders and tokenizations (off the event loop when async)."""

    function: Callable[..., Any]
    args: tuple[Any, ...]


@dataclass(frozen=True, slots=True)
class Flight:
    """The entry of ``plan``'s key, computed once however many requests wait for it."""

    plan: Any


Step = Lookup | Work | Flight

class Driven:
    """A decision sequence being driven: its next step, given the last one's outcome, and its
    answer once it returns. A driver sets ``outcome`` to ``(True, value)`` or ``(False,
    error)``; an error is raised inside the sequence where it asked."""

    __slots__ = ("outcome", "result", "steps")

    def __init__(self, steps: Generator[Step, Any, Any]) -> None:
        self.steps = steps
        self.outcome: tuple[bool, Any] = (True, None)
        self.result: Any = None

    def next_step(self) -> Step | None:
        """The step the sequence asks for next; None once it has returned (``result``)."""
        ok, value = self.outcome
        try:
            return self.steps.send(value) if ok else self.steps.throw(value)
        except StopIteration as done:
            self.result = done.value
            return None
