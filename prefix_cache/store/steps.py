"""A store operation written once for its sync and its async form (sans-IO, as redis-py shares
its commands between its two clients): the operation is a generator that yields each call it
needs from the store below, as ``(method, args)``, and returns its answer; ``run`` makes the
calls with the sync methods, ``arun`` awaits their async twins (``a`` + method; ``_a`` + the
rest for a private ``_method``), and ``twins`` makes a store's pair of methods out of one
operation. A call that fails raises inside the operation, where it yielded, as a plain call
would: the operation may catch it."""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Generator
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
            try:
                answer = getattr(store, method)(*args)
            except Exception as exc:  # noqa: BLE001 - raised inside the operation instead
                method, args = steps.throw(exc)
                continue
            method, args = steps.send(answer)
    except StopIteration as done:
        return done.value


async def arun(store: Any, steps: Steps[T]) -> T:
    """The operation's answer, each call awaited on ``store``'s async twin of the method."""
    try:
        method, args = next(steps)
        while True:
            try:
                answer = await getattr(store, async_name(method))(*args)
            except Exception as exc:  # noqa: BLE001 - raised inside the operation instead
                method, args = steps.throw(exc)
                continue
            method, args = steps.send(answer)
    except StopIteration as done:
        return done.value


def async_name(method: str) -> str:
    """A sync method's async twin: ``get`` -> ``aget``, ``_call`` -> ``_acall``."""
    return "_a" + method[1:] if method.startswith("_") else "a" + method


def twins(operation: Callable[Concatenate[S, P], Steps[T]], below: str | None = None) -> tuple[
        Callable[Concatenate[S, P], T], Callable[Concatenate[S, P], Coroutine[Any, Any, T]]]:
    """The sync and the async method of ``operation``, its calls made on ``self.<below>``
    (None: on ``self``): ``get, aget = twins(_get, "inner")`` in a class body."""

    def sync(self: S, *args: P.args, **kwargs: P.kwargs) -> T:
        store = self if below is None else getattr(self, below)
        return run(store, operation(self, *args, **kwargs))

    async def asynchronous(self: S, *args: P.args, **kwargs: P.kwargs) -> T:
        store = self if below is None else getattr(self, below)
        return await arun(store, operation(self, *args, **kwargs))

    sync.__doc__ = asynchronous.__doc__ = operation.__doc__
    return sync, asynchronous
