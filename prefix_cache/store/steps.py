"""A store operation written once for its sync and its async form (sans-IO, as redis-py shares
its commands between its two clients): the operation is a generator that yields each call it
needs from the store below, as ``(method, args)``, and returns its answer; ``run`` makes the
calls with the sync methods, ``arun`` awaits their async twins (``a`` + method), and ``twins``
makes a store's pair of methods out of one operation."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Generator
from typing import Any, Concatenate, ParamSpec, TypeVar

T = TypeVar("T")
S = TypeVar("S")
P = ParamSpec("P")

Call = tuple[str, tuple[Any, ...]]     # ("get", (key,)): the store below's method and arguments
Steps = Generator[Call, Any, T]


def run(store: Any, steps: Steps[T]) -> T:
    """The operation's answer, each call made on ``store`` with its sync method."""
    try:
        method, args = next(steps)
        while True:
            method, args = steps.send(getattr(store, method)(*args))
    except StopIteration as done:
        return done.value


async def arun(store: Any, steps: Steps[T]) -> T:
    """The operation's answer, each call awaited on ``store``'s async twin of the method."""
    try:
        method, args = next(steps)
        while True:
            method, args = steps.send(await getattr(store, "a" + method)(*args))
    except StopIteration as done:
        return done.value


def twins(operation: Callable[Concatenate[S, P], Steps[T]], below: str) -> tuple[
        Callable[Concatenate[S, P], T], Callable[Concatenate[S, P], Awaitable[T]]]:
    """The sync and the async method of ``operation``, its calls made on ``self.<below>``:
    ``get, aget = twins(_get, "inner")`` in a class body."""

    def sync(self: S, *args: P.args, **kwargs: P.kwargs) -> T:
        return run(getattr(self, below), operation(self, *args, **kwargs))

    async def asynchronous(self: S, *args: P.args, **kwargs: P.kwargs) -> T:
        return await arun(getattr(self, below), operation(self, *args, **kwargs))

    sync.__doc__ = asynchronous.__doc__ = operation.__doc__
    return sync, asynchronous
