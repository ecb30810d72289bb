"""The batched MLX engine: static-prefix KV reuse equals dense prefill, namespaces, batching,
sampling, streaming. Tiny random-weights models in float32; logits are compared, not tokens."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace
from typing import Any

import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

from engine_adapter.mlx_engine import (  # noqa: E402
    GenerationRequest,
    KVSnapshotStore,
    MLXEngine,
)
from engine_adapter.mlx_engine.model_info import context_length  # noqa: E402
from engine_adapter.testing.reference import dense_logprobs  # noqa: E402
from tests.support.engine_fixtures import (  # noqa: E402
    assert_close,
    assert_matches_dense,
    load_tiny,
    run,
    turn,
)


@pytest.fixture
def make_engine(engines):
    # These tests pin the static-prefix path; tests/engine/test_conversation.py covers the
    # conversation store (on by default), which would restore repeated prompts whole.
    return lambda **options: engines(**{"reuse_conversation_kv": False, **options})


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen2"])
def test_reused_static_kv_gives_the_dense_distribution(arch, engine_models_dir, qwen3):
    model, tok = load_tiny(engine_models_dir, arch), qwen3
    # The static path itself: with the conversation store on, the second prompt would restore
    # the header tokens it shares with the first too.
    with MLXEngine(model, reuse_conversation_kv=False) as engine:
        first, end = turn(tok, 12, "What is in the workspace?")
        second, end2 = turn(tok, 12, "Now list every file, recursively, with sizes.")
        assert end == end2 and first[:end] == second[:end]
        cold = run(engine, first, end)
        warm = run(engine, second, end)
        assert cold[0].prefill.reused_tokens == 0
        assert warm[0].prefill.reused_tokens == end
        assert warm[0].prefill.prefilled_tokens == len(second) - end
        assert_matches_dense(model, first, cold)
        assert_matches_dense(model, second, warm)


def test_decode_positions_continue_at_the_full_prompt_length(make_engine, target):
    model, tok = target
    engine = make_engine()
    ids, end = turn(tok, 20, "Summarize the tools.")
    run(engine, ids, end)                              # stores the static KV
    events = run(engine, ids, end, max_tokens=6)       # restored: only the rest is prefilled
    assert events[0].prefill.reused_tokens == end
    assert [e.index for e in events] == list(range(6))
    assert events[-1].finish_reason == "length"
    assert_matches_dense(model, ids, events)


def test_restored_kv_is_not_changed_by_the_requests_that_use_it(make_engine, target):
    model, tok = target
    engine = make_engine()
    ids, end = turn(tok, 8, "One.")
    run(engine, ids, end, max_tokens=8)
    for user in ("Two.", "Three, a longer one with more words in it."):
        other, _ = turn(tok, 8, user)
        events = run(engine, other, end)
        assert events[0].prefill.reused_tokens == end
        assert_close(events[0].logprobs, dense_logprobs(model, other))


def test_two_namespaces_with_the_same_prefix_never_share_kv(make_engine, target):
    _, tok = target
    store = KVSnapshotStore()
    engine = make_engine(kv_store=store)
    ids, end = turn(tok, 10, "Hello.")
    a1 = run(engine, ids, end, namespace="tenant-a")
    b1 = run(engine, ids, end, namespace="tenant-b")
    a2 = run(engine, ids, end, namespace="tenant-a")
    assert a1[0].prefill.reused_tokens == 0
    assert b1[0].prefill.reused_tokens == 0          # same ids, other tenant: computed again
    assert a2[0].prefill.reused_tokens == end
    assert store.stats.by_namespace == {"tenant-a": 1, "tenant-b": 1}
    assert store.purge("tenant-a") == 1
    assert run(engine, ids, end, namespace="tenant-a")[0].prefill.reused_tokens == 0


def test_the_kv_store_stays_within_its_byte_bound(make_engine, target):
    _, tok = target
    ids, end = turn(tok, 10, "Hello.")
    probe = make_engine(kv_store=KVSnapshotStore())
    run(probe, ids, end)
    one_entry = probe.kv_store.nbytes
    store = KVSnapshotStore(int(one_entry * 1.5))
    engine = make_engine(kv_store=store)
    for ns in ("a", "b", "c"):
        run(engine, ids, end, namespace=ns)
        assert store.nbytes <= store.max_bytes
    assert len(store) == 1 and store.stats.evictions == 2
    assert run(engine, ids, end, namespace="c")[0].prefill.reused_tokens == end


def test_concurrent_requests_are_batched_and_each_matches_dense(make_engine, target):
    model, tok = target
    engine = make_engine(max_batch_size=8, prefill_batch_size=8)
    warm, end = turn(tok, 10, "warm-up")
    run(engine, warm, end)
    prompts = [turn(tok, 10, "short"), turn(tok, 10, "a much longer question " * 6),
               turn(tok, 4, "another static part"), turn(tok, 10, "medium length question " * 2),
               turn(tok, 0, "tiny")]
    arrivals: list[str] = []
    results: dict[str, list[Any]] = {}
    done = threading.Event()
    lock = threading.Lock()
    requests = [GenerationRequest(ids, max_tokens=4, specprefill_system_end=e,
                                  return_logprobs=True, namespace=f"ns{i % 2}")
                for i, (ids, e) in enumerate(prompts)]

    def deliver(event: Any) -> None:
        assert not isinstance(event, BaseException), event
        with lock:
            arrivals.append(event.request_id)
            results.setdefault(event.request_id, []).append(event)
            if sum(1 for evs in results.values() if evs[-1].finish_reason) == len(requests):
                done.set()

    for request in requests:
        engine.submit(request, deliver)
    assert done.wait(60)
    for request in requests:
        events = results[request.request_id]
        assert [e.index for e in events] == [0, 1, 2, 3]
        assert_matches_dense(model, list(request.prompt_ids), events)
    # Batched, not one after another: some request gets a token before another one finishes.
    first_done = min(max(i for i, r in enumerate(arrivals) if r == q.request_id) for q in requests)
    started_later = [q for q in requests if arrivals.index(q.request_id) < first_done]
    assert len(started_later) > 1


def test_seeded_sampling_is_reproducible_and_top_p_near_zero_is_greedy(make_engine, target):
    _, tok = target
    engine = make_engine()
    ids, end = turn(tok, 4, "Sample something.")

    def tokens(**sampling: Any) -> list[int]:
        return [e.token for e in run(engine, ids, end, max_tokens=8, **sampling)]

    hot = {"temperature": 50.0}
    assert tokens(seed=7, **hot) == tokens(seed=7, **hot)
    assert tokens(seed=7, **hot) != tokens(seed=8, **hot)
    assert tokens(temperature=50.0, top_p=1e-9, seed=1) == tokens()


def test_stop_tokens_end_the_request(make_engine, target):
    _, tok = target
    engine = make_engine()
    ids, end = turn(tok, 4, "Stop early.")
    greedy = [e.token for e in run(engine, ids, end, max_tokens=5)]
    assert len(greedy) == 5
    # The first token that has not appeared before it is where a stop on it must end the stream.
    k = next((i for i in range(1, 5) if greedy[i] not in greedy[:i]), 0)
    events = run(engine, ids, end, max_tokens=5, stop_token_ids=[greedy[k]])
    assert [e.token for e in events] == greedy[:k + 1]
    assert events[-1].finish_reason == "stop"


def test_async_iterator_streams_the_same_tokens(make_engine, target):
    _, tok = target
    engine = make_engine()
    ids, end = turn(tok, 6, "Stream it.")
    expected = [e.token for e in run(engine, ids, end, max_tokens=5)]

    async def collect() -> list[int]:
        request = GenerationRequest(ids, max_tokens=5, specprefill_system_end=end)
        return [e.token async for e in engine.agenerate(request)]

    assert asyncio.run(collect()) == expected


def test_closing_the_stream_cancels_the_request(make_engine, target):
    _, tok = target
    engine = make_engine()
    ids, end = turn(tok, 4, "A long answer, please.")
    stream = engine.generate(GenerationRequest(ids, max_tokens=10_000, specprefill_system_end=end))
    assert next(stream).index == 0
    stream.close()
    run(engine, ids, end, max_tokens=1)                # processed after the cancel
    stats = engine.snapshot_stats()
    assert stats.cancelled == 1 and stats.active == 0


def test_a_boundary_at_the_end_of_the_prompt_keeps_the_last_token_for_generation(make_engine,
                                                                                  target):
    model, tok = target
    engine = make_engine()
    ids, _ = turn(tok, 4, "Everything static.")
    events = run(engine, ids, len(ids))
    assert events[0].prefill.static_tokens == len(ids) - 1
    assert_close(events[0].logprobs, dense_logprobs(model, ids))
    events = run(engine, ids, len(ids))
    assert events[0].prefill.reused_tokens == len(ids) - 1
    assert_close(events[0].logprobs, dense_logprobs(model, ids))


@pytest.mark.parametrize("fields, message", [
    ({"prompt_ids": []}, "prompt_ids"),
    ({"prompt_ids": [1, -2]}, "prompt_ids"),
    ({"prompt_ids": [10**9]}, "vocabulary"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"specprefill_system_end": 99}, "specprefill_system_end"),
    ({"namespace": ""}, "namespace"),
    ({"temperature": -1.0}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"specprefill_keep_pct": 1.5}, "specprefill_keep_pct"),
    ({"max_tokens": 32766}, "over the model's context of 32768"),   # 3 + 32766 tokens
])
def test_invalid_requests_are_refused_naming_the_field(make_engine, fields, message):
    engine = make_engine()
    base = {"prompt_ids": [1, 2, 3]}
    with pytest.raises(ValueError, match=message):
        engine.submit(GenerationRequest(**{**base, **fields}), lambda _e: None)


def test_max_context_lowers_the_models_window(make_engine):
    engine = make_engine(max_context=8)
    assert engine.context_length == 8
    with pytest.raises(ValueError, match="ask for at most 5"):
        engine.submit(GenerationRequest([1, 2, 3], max_tokens=6), lambda _e: None)
    with pytest.raises(ValueError, match="the prompt has 8 tokens"):
        engine.submit(GenerationRequest(list(range(8)), max_tokens=1), lambda _e: None)
    events = list(engine.generate(GenerationRequest([1, 2, 3], max_tokens=5)))
    assert len(events) == 5 and events[-1].finish_reason == "length"
    assert make_engine(max_context=10**9).context_length == 32768   # never above the model's


@pytest.mark.parametrize("args, expected", [
    ({"max_position_embeddings": 32768}, 32768),
    ({"max_position_embeddings": 32768, "rope_scaling": {"type": "yarn", "factor": 4.0}}, 131072),
    ({"max_position_embeddings": 131072,
      "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, 131072),   # already the window
    ({"max_position_embeddings": 4096, "rope_scaling": None}, 4096),
    ({}, None),
])
def test_context_length_reads_the_config(args, expected):
    assert context_length(SimpleNamespace(args=SimpleNamespace(**args))) == expected


def test_a_closed_engine_refuses_requests(target):
    model, _ = target
    engine = MLXEngine(model)
    assert engine.health() == {"ok": True, "active": 0, "queued": 0, "sparse_prefills": 0,
                               "disk_full": False}
    engine.close()
    assert engine.health()["ok"] is False
    from engine_adapter.mlx_engine import EngineError

    with pytest.raises(EngineError):
        engine.submit(GenerationRequest([1, 2, 3]), lambda _e: None)


def submit_together(engine: MLXEngine, requests: list[GenerationRequest],
                    cancel: str | None = None) -> tuple[dict[str, list[Any]], Any]:
    """Submit (and cancel) so that the engine thread takes it all in one go."""
    results: dict[str, list[Any]] = {r.request_id: [] for r in requests}
    finished = threading.Semaphore(0)

    def deliver(event: Any) -> None:
        if isinstance(event, BaseException):
            raise AssertionError(event)
        results[event.request_id].append(event)
        if event.finish_reason:
            finished.release()

    with engine.together():  # the engine thread cannot drain its inbox until all are in
        for r in requests:
            engine.submit(r, deliver)
        if cancel is not None:
            engine.cancel(cancel)
    return results, finished


def test_concurrent_misses_on_one_static_prefix_compute_it_once(make_engine, target):
    model, tok = target
    engine = make_engine()
    prompts = [turn(tok, 30, f"question {i} " * (i + 1)) for i in range(4)]
    end = prompts[0][1]
    requests = [GenerationRequest(ids, max_tokens=2, specprefill_system_end=end,
                                  return_logprobs=True) for ids, _ in prompts]
    results, finished = submit_together(engine, requests)
    for _ in requests:
        assert finished.acquire(timeout=60)
    reused = sorted(results[r.request_id][0].prefill.reused_tokens for r in requests)
    assert reused == [0, end, end, end]
    assert engine.kv_store.stats.puts == 1 and engine.snapshot_stats().parked == 3
    for r in requests:
        assert_matches_dense(model, list(r.prompt_ids), results[r.request_id])


def test_a_cancelled_leader_hands_the_static_prefix_to_a_parked_request(make_engine, target):
    model, tok = target
    engine = make_engine()
    ids, end = turn(tok, 30, "leader")
    leader = GenerationRequest(ids, max_tokens=2, specprefill_system_end=end)
    followers = [GenerationRequest(turn(tok, 30, f"follower {i}")[0], max_tokens=2,
                                   specprefill_system_end=end, return_logprobs=True)
                 for i in range(2)]
    results, finished = submit_together(engine, [leader, *followers], cancel=leader.request_id)
    for _ in followers:
        assert finished.acquire(timeout=60)
    assert results[leader.request_id] == []
    assert engine.kv_store.stats.puts == 1 and engine.snapshot_stats().parked == 3
    reused = sorted(results[r.request_id][0].prefill.reused_tokens for r in followers)
    assert reused == [0, end]                      # one took over the lead, one restored it
    for r in followers:
        assert_matches_dense(model, list(r.prompt_ids), results[r.request_id])


def test_a_prefix_too_big_for_the_store_does_not_hold_up_the_others(make_engine, target):
    model, tok = target
    engine = make_engine(kv_store=KVSnapshotStore(1024))
    prompts = [turn(tok, 30, f"q{i}") for i in range(3)]
    requests = [GenerationRequest(ids, max_tokens=2, specprefill_system_end=e,
                                  return_logprobs=True) for ids, e in prompts]
    results, finished = submit_together(engine, requests)
    for _ in requests:
        assert finished.acquire(timeout=60)
    assert engine.kv_store.stats.rejected == 3
    for r in requests:
        assert results[r.request_id][0].prefill.reused_tokens == 0
        assert_matches_dense(model, list(r.prompt_ids), results[r.request_id])
