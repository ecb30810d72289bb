"""Fair prefill: a tenant that floods the engine with long prompts does not make another tenant's
short prompt wait for all of them. Checked by the order of first tokens on the real engine
(the tiny model), never by timings; ``bench/fair_prefill.py`` measures the TTFTs."""

from __future__ import annotations

import threading
from typing import Any

import pytest

pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

from engine_adapter.mlx_engine import GenerationRequest  # noqa: E402
from engine_adapter.mlx_engine.prefill import FairPrefill  # noqa: E402

FLOOD, FLOOD_TOKENS, STEP, SLOTS = 6, 2048, 128, 2


def first_tokens(engine: Any, requests: list[GenerationRequest]) -> list[str]:
    """The request ids in the order their first tokens came out (all submitted at once)."""
    order: list[str] = []
    done = threading.Event()
    left = [len(requests)]
    lock = threading.Lock()

    def deliver_for(request_id: str) -> Any:
        def deliver(item: Any) -> None:
            if isinstance(item, Exception):
                done.set()
                raise item
            with lock:
                if item.index == 0:
                    order.append(request_id)
                if item.finish_reason is not None:
                    left[0] -= 1
                    if left[0] == 0:
                        done.set()
        return deliver

    for request in requests:
        engine.submit(request, deliver_for(request.request_id))
    assert done.wait(120) and left[0] == 0, "the requests did not finish"
    return order


def flood_and_quiet(vocab: int) -> list[GenerationRequest]:
    flood = [GenerationRequest([(7 * i + j) % vocab for j in range(FLOOD_TOKENS)], max_tokens=1,
                               namespace="flood", request_id=f"flood-{i}")
             for i in range(FLOOD)]
    quiet = GenerationRequest(list(range(100, 116)), max_tokens=1, namespace="quiet",
                              request_id="quiet")
    return [*flood, quiet]


@pytest.mark.parametrize("fair", [True, False])
def test_a_quiet_tenant_is_not_queued_behind_a_flood(engines: Any, fair: bool) -> None:
    engine = engines(prefill_batch_size=SLOTS, prefill_step_size=STEP, fair_prefill=fair,
                     reuse_static_kv=False, reuse_conversation_kv=False)
    order = first_tokens(engine, flood_and_quiet(engine.vocab_size))
    if fair:  # it takes the slot held back for another namespace: before most of the flood
        assert order.index("quiet") <= 1, order
    else:     # first come first served: behind every flood prompt
        assert order[-1] == "quiet", order


def test_slots_are_shared_equally_between_namespaces() -> None:
    fair: FairPrefill[str] = FairPrefill(4)
    for i in range(6):
        fair.push("a", f"a{i}")
    assert fair.pop_ready() == ["a0", "a1", "a2"]  # one namespace alone: one slot held back
    for i in range(3):
        fair.push("b", f"b{i}")
    assert fair.pop_ready() == ["b0"]               # the newcomer takes it at once
    fair.free("a0")
    fair.free("a1")
    assert fair.pop_ready() == ["a3", "b1"]         # two each: the equal share of four
    fair.free("a2")
    assert fair.pop_ready() == ["a4"]               # a's freed slot: b already has its share
    fair.discard("a5")                              # cancelled while waiting
    fair.free("b0")
    assert fair.pop_ready() == ["b2"]
    assert len(fair) == 0
    with pytest.raises(ValueError, match="slots"):
        FairPrefill(0)
