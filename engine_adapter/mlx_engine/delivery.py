"""A request's token events as an iterator: blocking, or for asyncio. The engine thread
delivers each event (then possibly one exception) through a callback; leaving an iterator
before the last event cancels the request."""

from __future__ import annotations

import asyncio
import queue
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from .request import CheckedRequest, GenerationRequest, TokenEvent

Request = GenerationRequest | CheckedRequest
Submit = Callable[[Request, Callable[[Any], None]], None]
Cancel = Callable[[str], None]


def blocking_events(submit: Submit, cancel: Cancel,
                    request: Request) -> Iterator[TokenEvent]:
    """Events as they come, blocking between them."""
    events: queue.SimpleQueue[Any] = queue.SimpleQueue()
    submit(request, events.put)
    done = False
    try:
        while not done:
            item = events.get()
            if isinstance(item, BaseException):
                done = True
                raise item
            done = item.finish_reason is not None
            yield item
    finally:
        if not done:
            cancel(request.request_id)


async def async_events(submit: Submit, cancel: Cancel,
                       request: Request) -> AsyncIterator[TokenEvent]:
    """Events as they come, awaited on the running loop (a FastAPI streaming response)."""
    loop = asyncio.get_running_loop()
    events: asyncio.Queue[Any] = asyncio.Queue()

    def deliver(item: Any) -> None:
        loop.call_soon_threadsafe(events.put_nowait, item)

    submit(request, deliver)
    done = False
    try:
        while not done:
            item = await events.get()
            if isinstance(item, BaseException):
                done = True
                raise item
            done = item.finish_reason is not None
            yield item
    finally:
        if not done:
            cancel(request.request_id)
