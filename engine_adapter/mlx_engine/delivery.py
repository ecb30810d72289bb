"""A request's token events as an iterator: blocking, or for asyncio. The engine thread
delivers each event (then possibly one exception) through a callback; leaving an iterator
before the last event cancels the request."""

from __future__ import annotations

import asyncio
import queue
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from .request import GenerationRequest, TokenEvent

Submit = Callable[[GenerationRequest, Callable[[Any], None]], None]
Cancel = Callable[[str], None]


class _Stream:
    """Where a request's stream stands: which items end it, and a cancel when left early."""

    def __init__(self, cancel: Cancel, request_id: str) -> None:
        self.cancel, self.request_id, self.done = cancel, request_id, False

    def take(self, item: Any) -> TokenEvent:
        """The event ``item`` is; an exception delivered ends the stream and is raised."""
        if isinstance(item, BaseException):
            self.done = True
            raise item
        self.done = item.finish_reason is not None
        return item

    def leave(self) -> None:
        if not self.done:  # left before the last event: the engine stops generating it
            self.cancel(self.request_id)


def blocking_events(submit: Submit, cancel: Cancel,
                    request: GenerationRequest) -> Iterator[TokenEvent]:
    """Events as they come, blocking between them."""
    events: queue.SimpleQueue[Any] = queue.SimpleQueue()
    stream = _Stream(cancel, request.request_id)
    submit(request, events.put)
    try:
        while not stream.done:
            yield stream.take(events.get())
    finally:
        stream.leave()


async def async_events(submit: Submit, cancel: Cancel,
                       request: GenerationRequest) -> AsyncIterator[TokenEvent]:
    """Events as they come, awaited on the running loop (a FastAPI streaming response)."""
    loop = asyncio.get_running_loop()
    events: asyncio.Queue[Any] = asyncio.Queue()

    def deliver(item: Any) -> None:
        loop.call_soon_threadsafe(events.put_nowait, item)

    stream = _Stream(cancel, request.request_id)
    submit(request, deliver)
    try:
        while not stream.done:
            yield stream.take(await events.get())
    finally:
        stream.leave()
