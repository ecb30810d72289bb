"""The step's token budget (``mlx_engine/budget.py``): decode first, then prefill chunks shared
across namespaces. Checked on the real engine (the tiny model) by the order of what happens
on its thread (prefill chunks, tokens), never by timings; ``bench/fair_prefill.py`` and
``bench/step_itl.py`` measure TTFT and inter-token latency."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import pytest

pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

from engine_adapter.mlx_engine import GenerationRequest  # noqa: E402
from engine_adapter.mlx_engine.budget import StepBudget, StepClock  # noqa: E402

FLOOD, FLOOD_TOKENS, STEP_TOKENS = 6, 1024, 128


class Recording:
    """The target model, with each call on the engine thread written to a shared log: a
    prefill chunk (more than one token in a row) as ("chunk", id of its cache, tokens)."""

    def __init__(self, model: Any, log: list[tuple[Any, ...]]) -> None:
        self._model = model
        self._log = log

    def __call__(self, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        if inputs.shape[-1] > 1:
            self._log.append(("chunk", id(kwargs.get("cache")), inputs.size))
        return self._model(inputs, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


def submit_all(engine: Any, requests: list[GenerationRequest], log: list[tuple[Any, ...]],
               ) -> tuple[dict[str, list[int]], Any]:
    """Submit ``requests`` together; each one's tokens as they come, and ("token", request id)
    in ``log`` as each is delivered (on the engine thread, in order with the chunks); and a
    call that waits for them all to finish."""
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    done = threading.Event()
    left = [len(requests)]

    def deliver_for(request_id: str) -> Any:
        def deliver(item: Any) -> None:
            if isinstance(item, Exception):
                done.set()
                raise item
            log.append(("token", request_id))
            tokens[request_id].append(item.token)
            if item.finish_reason is not None:
                left[0] -= 1
                if left[0] == 0:
                    done.set()
        return deliver

    with engine.together():
        for request in requests:
            engine.submit(request, deliver_for(request.request_id))

    def wait() -> dict[str, list[int]]:
        assert done.wait(180) and left[0] == 0, "the requests did not finish"
        return tokens

    return tokens, wait


def run_all(engine: Any, requests: list[GenerationRequest], log: list[tuple[Any, ...]],
            ) -> dict[str, list[int]]:
    return submit_all(engine, requests, log)[1]()


def flood(vocab: int, n: int = FLOOD, tokens: int = FLOOD_TOKENS) -> list[GenerationRequest]:
    return [GenerationRequest([(7 * i + 3 * j + 11) % vocab for j in range(tokens)],
                              max_tokens=1, namespace="flood", request_id=f"flood-{i}")
            for i in range(n)]


@pytest.mark.parametrize("fair", [True, False])
def test_a_quiet_tenants_first_token_comes_before_most_of_a_floods_chunks(
        engines: Any, target: tuple[Any, Any], fair: bool) -> None:
    log: list[tuple[Any, ...]] = []
    engine = engines(Recording(target[0], log), fair_prefill=fair, step_tokens=STEP_TOKENS,
                     prefill_batch_size=2, prefill_step_size=STEP_TOKENS,
                     reuse_static_kv=False, reuse_conversation_kv=False)
    quiet = GenerationRequest(list(range(100, 140)), max_tokens=1, namespace="quiet",
                              request_id="quiet")
    run_all(engine, [*flood(engine.vocab_size), quiet], log)
    first = log.index(("token", "quiet"))
    chunks = [e for e in log if e[0] == "chunk"]
    flood_tokens_before = sum(e[2] for e in log[:first] if e[0] == "chunk") - 40
    if fair:  # its share of the first step: before 1/10 of the flood's prompt tokens
        assert flood_tokens_before <= FLOOD * FLOOD_TOKENS // 10, (flood_tokens_before, chunks)
        assert [e for e in log if e[0] == "token"][0] == ("token", "quiet")
        # its step ends once its only prompt is in: no flood chunk before its first token
        own = max(i for i, e in enumerate(log[:first]) if e[0] == "chunk" and e[2] == 39)
        assert not [e for e in log[own + 1:first] if e[0] == "chunk"], log[own:first + 1]
    else:     # first come first served: behind every flood prompt
        assert flood_tokens_before >= FLOOD * FLOOD_TOKENS - 2 * STEP_TOKENS
        assert [e for e in log if e[0] == "token"][-1] == ("token", "quiet")


def test_a_running_stream_gets_a_token_between_any_two_chunks_of_another_prompt(
        engines: Any, target: tuple[Any, Any]) -> None:
    log: list[tuple[Any, ...]] = []
    # Plain decoding: a speculative step's verify forward (several tokens a row) would be
    # logged as a chunk, and its drafts are charged to the next step's budget, not this one's.
    engine = engines(Recording(target[0], log), step_tokens=STEP_TOKENS,
                     reuse_static_kv=False, reuse_conversation_kv=False, speculative=False)
    stream = GenerationRequest(list(range(200, 230)), max_tokens=100, namespace="chat",
                               request_id="stream")
    long = flood(engine.vocab_size, n=2)           # 2 x 1024 tokens: 16+ chunks
    tokens, stream_done = submit_all(engine, [stream], log)
    while not tokens["stream"]:                    # the stream is decoding
        time.sleep(0.01)
    run_all(engine, long, log)
    assert len(stream_done()["stream"]) == 100
    stream_ends = max(i for i, e in enumerate(log) if e == ("token", "stream"))
    by_prompt: dict[int, list[int]] = {}
    for i, e in enumerate(log[:stream_ends]):
        if e[0] == "chunk":
            by_prompt.setdefault(e[1], []).append(i)
    assert sum(len(v) for v in by_prompt.values()) >= 16
    for where in by_prompt.values():
        for a, b in zip(where, where[1:], strict=False):
            assert ("token", "stream") in log[a:b], log[a:b + 1]
    # and what is prefilled between two of its tokens is at most one step's budget
    tokens_at = [i for i, e in enumerate(log[:stream_ends + 1]) if e == ("token", "stream")]
    for a, b in zip(tokens_at, tokens_at[1:], strict=False):
        assert sum(e[2] for e in log[a:b] if e[0] == "chunk") <= STEP_TOKENS, log[a:b]


@dataclass
class _Job:
    request_id: str
    namespace: str
    left: int
    chunk: int | None = None


def test_the_budget_decodes_first_and_shares_prefill_across_namespaces() -> None:
    budget = StepBudget(512, min_chunk=32)
    a = [_Job(f"a{i}", "a", 1000) for i in range(3)]
    b = _Job("b0", "b", 100)
    for job in [*a, b]:
        budget.add(job)
    plan = budget.schedule(decoding=12)                # 500 to prefill, two namespaces
    # 250 each; b needs 100, so a's oldest takes the other 150 too; b finishes: it runs first
    assert [(j.request_id, n) for j, n in plan] == [("b0", 100), ("a0", 400)]
    budget.discard("b0")
    budget.add(b)
    assert [(j.request_id, n) for j, n in budget.schedule(decoding=12, prefill=64)] == [
        ("a0", 32), ("b0", 32)]                        # a step sized by time (StepClock)
    b.left = 0
    budget.discard("b0")
    a[0].left -= 400
    plan = budget.schedule(decoding=0)                 # a alone: all of it, oldest first
    assert [(j.request_id, n) for j, n in plan] == [("a0", 512)]
    assert budget.schedule(decoding=512) == []         # decode fills the step
    sparse = _Job("s0", "s", 5000, chunk=400)         # a SpecPrefill: one chunk, over its part
    budget.add(sparse)
    plan = budget.schedule(decoding=0)
    assert [(j.request_id, n) for j, n in plan][-1] == ("s0", 400)
    plan = budget.schedule(decoding=0)                 # its overdraft (144) comes off its part
    assert ("s0", 400) in [(j.request_id, n) for j, n in plan]
    assert sum(n for j, n in plan if j.namespace == "a") >= 512 - 400
    for i in range(20):                                # many namespaces: 32-token parts at
        budget.add(_Job(f"n{i}", f"n{i}", 64))         # least, the order rotates
    seen: set[str] = set()
    for _ in range(3):
        seen |= {j.namespace for j, _ in budget.schedule(decoding=0)}
    assert {f"n{i}" for i in range(20)} <= seen
    with pytest.raises(ValueError, match="budget"):
        StepBudget(0)


def test_a_step_ended_early_keeps_the_turn_of_what_it_did_not_run() -> None:
    budget = StepBudget(64, min_chunk=32)
    x, y = _Job("x0", "x", 1000), _Job("y0", "y", 1000)
    budget.add(x)
    budget.add(y)
    plan = budget.schedule(decoding=0)
    assert [j.request_id for j, _ in plan] == ["x0", "y0"]
    budget.unrun([y])                                  # the engine ran x's chunk only
    assert [j.request_id for j, _ in budget.schedule(decoding=0, prefill=32)] == ["y0"]


def test_while_a_stream_runs_a_steps_prefill_takes_about_one_decode_step() -> None:
    clock = StepClock(floor=16)
    assert clock.prefill_tokens(1024, streaming=True) == 1024     # nothing measured yet
    clock.decoded(0.010)
    clock.prefilled(100, 0.050)                                    # 0.5 ms a token
    assert clock.prefill_tokens(1024, streaming=True) == 20        # 10 ms of prefill
    assert clock.prefill_tokens(1024, streaming=False) == 1024     # no stream to hold up
    clock.prefilled(10, 1.0)                                       # deep in a long prompt
    assert clock.prefill_tokens(1024, streaming=True) == 16        # never under the floor
    assert clock.prefill_tokens(8, streaming=True) == 8            # nor over the budget


def test_a_budget_the_decode_batch_fills_is_refused_naming_both_options() -> None:
    from engine_adapter.options import EngineOptions

    assert EngineOptions.parse({"step_tokens": 1024}).engine_kwargs()["step_tokens"] == 1024
    with pytest.raises(ValueError, match=r"step_tokens \(16\) must be more than max_batch_size"):
        EngineOptions.parse({"step_tokens": 16, "max_batch_size": 16})
    assert EngineOptions.parse({"step_tokens": 16, "fair_prefill": False})  # unused then


def test_chunking_never_changes_an_answer(engines: Any, target: tuple[Any, Any]) -> None:
    """Greedy answers under a small budget, with other tenants' prompts, a static prefix
    being stored and a request parked on it, equal each request run alone, first come first
    served, with no reuse."""
    vocab = target[0].args.vocab_size
    static = [(5 * j + 1) % vocab for j in range(300)]
    requests = [
        GenerationRequest(static + [(11 * j + i) % vocab for j in range(40 + 70 * i)],
                          max_tokens=12, namespace=f"t{i % 2}", request_id=f"r{i}",
                          specprefill_system_end=300)
        for i in range(4)]
    requests.append(GenerationRequest([(13 * j) % vocab for j in range(900)], max_tokens=12,
                                      namespace="t2", request_id="long"))
    alone = engines(fair_prefill=False, reuse_static_kv=False, reuse_conversation_kv=False)
    expected = {r.request_id: [e.token for e in alone.generate(r)] for r in requests}
    budgeted = engines(step_tokens=48)
    log: list[tuple[Any, ...]] = []
    assert run_all(budgeted, requests, log) == expected
    stats = budgeted.snapshot_stats()
    assert stats.parked >= 1 and stats.reused_tokens >= 300   # the prefix computed once
