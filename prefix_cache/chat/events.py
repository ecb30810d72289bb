"""What an assistant turn is made of, whoever produced it: the neutral events the agent APIs
format (Anthropic Messages, OpenAI Responses), from an in-process engine or from an upstream
that speaks chat completions.

    TextDelta      a piece of the answer's text
    ReasoningDelta a piece of the model's reasoning, apart from the answer (it comes first)
    ToolCallDelta  a piece of one tool call: its first piece has the call's id and name, the
                   rest add to its arguments (JSON text)
    Prefilled      the prompt's counts once the engine has prefilled it (how many tokens it
                   restored), before the answer's first piece; a source that cannot tell
                   (an upstream's chat completion) sends none
    Finish         the last event: "stop", "length" or "tool_calls", the usage, and the stop
                   string that ended the turn when one did

A source that fails after it started raises ``BackendError``; the formatters end their stream
with the API's error event.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass, field

from ..engine.protocol import ChatBackend, Checked, Usage


@dataclass(frozen=True, slots=True)
class TextDelta:
    text: str


@dataclass(frozen=True, slots=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(frozen=True, slots=True)
class Prefilled:
    usage: Usage    # prompt_tokens and cached_tokens; completion_tokens 0


@dataclass(frozen=True, slots=True)
class Finish:
    reason: str
    usage: Usage = Usage(0, 0)
    stop_sequence: str | None = None


OutputEvent = TextDelta | ReasoningDelta | ToolCallDelta | Prefilled | Finish
Events = AsyncGenerator[OutputEvent, None]  # one turn's, in order, ending with a Finish


def new_call_id(prefix: str = "call_") -> str:
    return prefix + uuid.uuid4().hex[:24]


async def backend_events(backend: ChatBackend[Checked],
                         checked: Checked) -> AsyncGenerator[OutputEvent, None]:
    """A checked request's generation as events: its text, and the tool calls the engine cut
    out of it (one whole call per event, or a call in pieces as it is written)."""
    finish, usage, stop = None, None, None
    calls = 0
    async with aclosing(backend.generate(checked)) as outputs:
        async for out in outputs:
            if out.usage is not None and out.finish_reason is None:
                yield Prefilled(out.usage)
            if out.reasoning:
                yield ReasoningDelta(out.reasoning)
            if out.text:
                yield TextDelta(out.text)
            for call in out.tool_calls:
                yield ToolCallDelta(calls, call.id, call.name, call.arguments)
                calls += 1
            for chunk in out.tool_call_chunks:  # a call as it is written: its index is its own
                yield ToolCallDelta(chunk.index, chunk.id, chunk.name, chunk.arguments)
                calls = max(calls, chunk.index + 1)
            finish, usage = out.finish_reason or finish, out.usage or usage
            stop = out.stop_sequence or stop
    yield Finish(finish or "length", usage or Usage(len(checked.request.prompt_ids), 0), stop)


@dataclass
class TurnEnd:
    """How a streamed turn started and finished, noted while its content events pass through
    ``content`` (a turn that ends without a ``Finish`` reads as cut at its length)."""

    finish: Finish = Finish("length")
    prefilled: Prefilled | None = None

    async def content(self, events: AsyncGenerator[OutputEvent, None]
                      ) -> AsyncGenerator[TextDelta | ReasoningDelta | ToolCallDelta, None]:
        async with aclosing(events):
            async for event in events:
                if isinstance(event, Finish):
                    self.finish = event
                elif isinstance(event, Prefilled):
                    self.prefilled = event
                else:
                    yield event


@dataclass
class CollectedCall:
    id: str
    name: str
    arguments: str = ""


@dataclass
class Collected:
    """A whole turn: its text, its reasoning, its tool calls in order, how it finished."""

    text: str = ""
    reasoning: str = ""
    calls: list[CollectedCall] = field(default_factory=list)
    finish: Finish = Finish("length")


async def collect(events: AsyncGenerator[OutputEvent, None]) -> Collected:
    """Every event of a turn, gathered (for an answer that is not streamed)."""
    turn = Collected()
    parts: list[str] = []
    thought: list[str] = []
    by_index: dict[int, CollectedCall] = {}
    async with aclosing(events):
        async for event in events:
            if isinstance(event, TextDelta):
                parts.append(event.text)
            elif isinstance(event, ReasoningDelta):
                thought.append(event.text)
            elif isinstance(event, ToolCallDelta):
                call = by_index.get(event.index)
                if call is None:
                    call = by_index[event.index] = CollectedCall(event.id or new_call_id(),
                                                                 event.name or "")
                    turn.calls.append(call)
                call.arguments += event.arguments
            elif isinstance(event, Finish):
                turn.finish = event
    turn.text, turn.reasoning = "".join(parts), "".join(thought)
    return turn
