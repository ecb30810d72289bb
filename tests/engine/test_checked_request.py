"""A request is checked once on its way into the engine: ``MLXEngine.check`` (or
``MLXBackend.check`` above it) makes a checked ``GenerationRequest`` (``checked``: the one
place) that ``submit``, ``generate`` and ``agenerate`` run as it is; a plain request is checked
there, and a check made for other limits (another engine's vocabulary or context) is not
trusted.

Tiny random-weights model (float32); the tokens compared are the engine's own, greedy.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

pytest.importorskip("mlx_lm")

from engine_adapter.backend import MLXBackend, MLXRequest  # noqa: E402
from engine_adapter.mlx_engine import GenerationRequest  # noqa: E402
from prefix_cache.engine.protocol import BackendRequest, SamplingParams  # noqa: E402
from prefix_cache.errors import ContextLengthError, InvalidRequestError  # noqa: E402
from prefix_cache.util.token_ids import TokenIds  # noqa: E402
from tests.support.engine_fixtures import turn  # noqa: E402


def tokens(events: list[Any]) -> list[int]:
    return [e.token for e in events]


def test_a_checked_request_runs_as_the_plain_one_does(engines: Any, qwen3: Any) -> None:
    engine = engines(reuse_conversation_kv=False, reuse_static_kv=False)
    ids, end = turn(qwen3, 3, "Count to three.")
    plain = GenerationRequest(ids, max_tokens=4, specprefill_system_end=end)
    checked = engine.check(plain)
    assert checked.limits == (engine.vocab_size, engine.context_length) and plain.limits is None
    assert checked.prompt_ids is plain.prompt_ids and checked == plain  # a list: as given
    assert tokens(engine.generate(checked)) == tokens(engine.generate(plain))


@pytest.mark.parametrize("given", [TokenIds.of_rendered, np.array], ids=["packed", "array"])
def test_ids_given_packed_or_as_an_array_run_as_their_list(engines: Any, qwen3: Any,
                                                          given: Any) -> None:
    engine = engines(reuse_conversation_kv=False, reuse_static_kv=False)
    ids, end = turn(qwen3, 3, "Count to three.")
    checked = engine.check(GenerationRequest(given(ids), max_tokens=3,
                                             specprefill_system_end=end))
    assert checked.prompt_ids == ids and type(checked.prompt_ids) is list
    assert tokens(engine.generate(checked)) == tokens(engine.generate(
        GenerationRequest(ids, max_tokens=3, specprefill_system_end=end)))


def test_a_check_made_for_other_limits_is_checked_again(engines: Any) -> None:
    engine = engines(max_context=8)
    unchecked = GenerationRequest([10**9], max_tokens=1).checked(None, None)
    with pytest.raises(InvalidRequestError, match="vocabulary") as info:
        engine.submit(unchecked, lambda _e: None)
    assert info.value.code == "invalid_prompt_token_ids"
    too_long = GenerationRequest([1, 2, 3], max_tokens=6).checked(engine.vocab_size, None)
    with pytest.raises(ContextLengthError, match="ask for at most 5"):
        asyncio.run(_first(engine.agenerate(too_long)))
    with pytest.raises(ContextLengthError):
        engine.check(GenerationRequest([1, 2, 3], max_tokens=6))


async def _first(events: Any) -> Any:
    async for event in events:
        return event


def test_the_backend_makes_the_engine_request_once(engines: Any, qwen3: Any) -> None:
    backend = MLXBackend(engines(), qwen3)
    ids, end = turn(qwen3, 3, "Hello.")
    packed = TokenIds.of_rendered(ids)
    checked = backend.check(BackendRequest(packed, end, sampling=SamplingParams(
        max_tokens=2, temperature=0.0)))
    assert isinstance(checked, MLXRequest) and checked.grammar is None
    # The engine's request holds the list the packed ids were made from: no copy, no repack.
    assert checked.engine.prompt_ids is packed.ids
    assert checked.engine.limits == (backend.vocab_size, backend.context_length)
    assert checked.engine.specprefill_system_end == end and checked.engine.max_tokens == 2
    assert checked.request.sampling.max_tokens == 2

    async def outputs() -> list[Any]:
        return [out async for out in backend.generate(checked)]

    outs = asyncio.run(outputs())
    assert outs[-1].usage.prompt_tokens == len(ids) and outs[-1].usage.completion_tokens == 2
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        backend.check(BackendRequest([10**9], 0))
