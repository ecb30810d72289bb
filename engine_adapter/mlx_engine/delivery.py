"""A request's token events as an iterator: blocking, or for asyncio. The engine thread
delivers each event (then possibly one exception) through a callback; leaving an iterator
before the last event cancels the request. What an item means is decided once
(``_Delivered``); the two iterators differ only in how they wait for the next one."""

from __future__ import annotations

import asyncio
import queue
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from .request import GenerationRequest, TokenEvent

Submit = Callable[[GenerationRequest, Callable[[Any], None]], None]
Cancel = Callable[[str], None]


class _Delivered:
    """A request's items as they arrive: an exception ends it by raising, the event with a
    finish reason ends it; one closed before its end is cancelled."""

    def __init__(self, cancel: Cancel, request_id: str) -> None:
        self.cancel, self.request_id = cancel, request_id
        self.done = False

    def take(self, item: Any) -> TokenEvent:
        if isinstance(item, BaseException):
            self.done = True
            raise item
        self.done = item.finish_reason is not None
        return item

    def close(self) -> None:
        if not self.done:
            self.cancel(self.request_id)


def blocking_events(submit: Submit, cancel: Cancel,
                    request: GenerationRequest) -> Iterator[TokenEvent]:
    """Events as they come, blocking between them."""
    events: queue.SimpleQueue[Any] = queue.SimpleQueue()
    submit(request, events.put)
    delivered = _Delivered(cancel, request.request_id)
    try:
        while not delivered.done:
            yield delivered.take(events.get())
    finally:
        delivered.close()


async def async_events(submit: Submit, cancel: Cancel,
                       request: GenerationRequest) -> AsyncIterator[TokenEvent]:
    """Events as they come, awaited on the running loop (a FastAPI streaming response)."""
    loop = asyncio.get_running_loop()
    events: asyncio.Queue[Any] = asyncio.Queue()

    def deliver(item: Any) -> None:
        loop.call_soon_threadsafe(events.put_nowait, item)

    submit(request, deliver)
    delivered = _Delivered(cancel, request.request_id)
    try:
        while not delivered.done:
            yield delivered.take(await events.get())
    finally:
        delivered.close()
