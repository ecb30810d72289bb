"""An operation written once as steps runs the same under its sync and its async driver: a
failed call raises inside the operation, where it yielded (so the operation may catch it, as
``RedisStore._ping`` does), and an operation that does not catch it fails with it. The real
stores' twins (Redis ping and warm-up, tiered and quota delete/purge) are in the contract
and Redis tests; this is the driver alone."""

from __future__ import annotations

import asyncio

import pytest

from prefix_cache.store.steps import Steps, async_name, twins


class Below:
    """A store below whose ``_read`` answers a key and fails on ``"down"``."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def _read(self, key: str) -> str:
        self.calls.append("sync " + key)
        if key == "down":
            raise ConnectionError(key)
        return key.upper()

    async def _aread(self, key: str) -> str:
        self.calls.append("async " + key)
        if key == "down":
            raise ConnectionError(key)
        return key.upper()

    def _answer(self, keys: list[str]) -> Steps[list[str]]:
        out = []
        for key in keys:
            try:
                out.append((yield "_read", (key,)))
            except ConnectionError:
                out.append("-")
        return out

    def _strict(self, key: str) -> Steps[str]:
        return (yield "_read", (key,))

    answer, aanswer = twins(_answer)      # on self: no store below by name
    strict, astrict = twins(_strict)


def test_a_failed_call_raises_inside_the_operation_on_both_drivers() -> None:
    store = Below()
    assert store.answer(["a", "down", "b"]) == ["A", "-", "B"]
    assert asyncio.run(store.aanswer(["a", "down", "b"])) == ["A", "-", "B"]
    assert store.calls == ["sync a", "sync down", "sync b", "async a", "async down", "async b"]


def test_an_operation_that_does_not_catch_fails_with_the_call() -> None:
    store = Below()
    assert store.strict("x") == "X" and asyncio.run(store.astrict("x")) == "X"
    with pytest.raises(ConnectionError, match="down"):
        store.strict("down")
    with pytest.raises(ConnectionError, match="down"):
        asyncio.run(store.astrict("down"))


def test_a_private_methods_twin_keeps_its_underscore() -> None:
    assert async_name("get") == "aget" and async_name("_call") == "_acall"
