"""SpecPrefill: draft scoring, chunk selection, sparse prefill at original RoPE positions, and
the engine paths around it (protected static prefix, decode positions, fallbacks)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

from engine_adapter.mlx_engine import (  # noqa: E402
    GenerationRequest,
    MLXEngine,
    SpecPrefillConfig,
)
from engine_adapter.mlx_engine.kv import cache as kv_cache  # noqa: E402
from engine_adapter.mlx_engine import specprefill_jobs as sparse_module  # noqa: E402
from engine_adapter.mlx_engine.rope import (  # noqa: E402
    PositionPlan,
    captured_queries,
    mapped_positions,
)
from engine_adapter.mlx_engine.specprefill import (  # noqa: E402
    attention_importance,
    avg_pool,
    score_tokens,
    select_chunks,
)
from engine_adapter.testing.reference import dense_logprobs, masked_logprobs  # noqa: E402
from prefix_cache.cache.boundary import common_prefix_len  # noqa: E402
from tests.support.engine_fixtures import (  # noqa: E402
    ATOL,
    assert_close,
    assert_matches_dense,
    load_tiny,
    restored_from,
    run,
)


SMALL = SpecPrefillConfig(keep_pct=0.3, threshold=0, chunk_size=8, tail_tokens=8)


def prompt(tok: Any, user_words: int) -> tuple[list[int], int]:
    static = tok.encode("<|im_start|>system\nYou are an agent. "
                        + " ".join(f"tool_{i}(path)" for i in range(10)) + "<|im_end|>\n")
    rest = tok.encode("<|im_start|>user\n" + " ".join(f"word{i}" for i in range(user_words))
                      + "<|im_end|>\n<|im_start|>assistant\n")
    return static + rest, len(static)


# -- selection and pooling (pure) ------------------------------------------------------------

@pytest.mark.parametrize("m, keep, chunk, tail, expected_chunks", [
    (64, 1.0, 8, 8, list(range(8))),              # keep everything
    (64, 0.375, 8, 8, [1, 5, 7]),                 # 3 kept: 2 by score + the tail chunk
    (64, 0.25, 8, 8, [1, 7]),                     # 2 kept: the tail is drawn from the budget
    (64, 0.25, 8, 16, [6, 7]),                    # 2 kept, both tail chunks
    (64, 0.1, 8, 32, [4, 5, 6, 7]),               # the tail floor wins over keep_pct
    (64, 0.25, 8, 0, [1, 5]),                     # no tail floor
    (60, 0.5, 8, 8, [1, 2, 5, 7]),                # a short last chunk is still a chunk
    (5, 0.2, 8, 8, [0]),                          # fewer tokens than a chunk
])
def test_select_chunks(m, keep, chunk, tail, expected_chunks):
    scores = [0.0] * m
    for c, value in ((1, 9.0), (5, 8.0), (2, 3.0), (6, 2.0)):
        for i in range(c * chunk, min((c + 1) * chunk, m)):
            scores[i] = value
    kept = select_chunks(scores, keep, chunk, tail)
    expected = [i for c in expected_chunks for i in range(c * chunk, min((c + 1) * chunk, m))]
    assert kept == expected
    assert kept == sorted(set(kept))


def test_keep_count_follows_keep_pct_when_the_tail_fits():
    kept = select_chunks(list(np.random.default_rng(0).random(32 * 100)), 0.2, 32, 512)
    assert len(kept) == 32 * math.ceil(100 * 0.2)
    assert kept[-512:] == list(range(3200 - 512, 3200))


def test_avg_pool_is_a_centred_zero_padded_mean():
    x = mx.array(np.random.default_rng(1).random((2, 3, 40)).astype(np.float32))
    got = np.array(avg_pool(x, 13))
    padded = np.pad(np.array(x), [(0, 0), (0, 0), (6, 6)])
    want = np.stack([padded[..., i:i + 13].mean(-1) for i in range(40)], axis=-1)
    np.testing.assert_allclose(got, want, atol=1e-6)


def test_importance_matches_a_naive_gqa_computation():
    rng = np.random.default_rng(2)
    n, heads, kv_heads, dim, steps = 30, 4, 2, 8, 3
    queries = [[mx.array(rng.standard_normal((1, heads, 1, dim)).astype(np.float32))
                for _ in range(steps)] for _ in range(2)]
    caches = []
    for _ in range(2):
        c = kv_cache.PositionedKVCache()
        k = mx.array(rng.standard_normal((1, kv_heads, n + steps, dim)).astype(np.float32))
        c.update_and_fetch(k, k)
        caches.append(c)
    got = np.array(attention_importance(queries, caches, n, [dim ** -0.5] * 2, 5))
    per_layer = []
    for qs, c in zip(queries, caches, strict=True):
        q = np.concatenate([np.array(x) for x in qs], axis=2)[0]            # (H, steps, D)
        assert c.keys is not None
        k = np.repeat(np.array(c.keys[..., :n, :])[0], heads // kv_heads, 0)  # (H, n, D)
        s = q @ k.transpose(0, 2, 1) * dim ** -0.5
        w = np.exp(s - s.max(-1, keepdims=True))
        w /= w.sum(-1, keepdims=True)
        padded = np.pad(w, [(0, 0), (0, 0), (2, 2)])
        per_layer.append(np.stack([padded[..., i:i + 5].mean(-1) for i in range(n)], -1))
    want = np.concatenate(per_layer, 0).max(0).mean(0)
    np.testing.assert_allclose(got, want, atol=1e-5)


# -- RoPE hooks ----------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen2"])
def test_captured_queries_are_the_models_post_rope_queries(arch, engine_models_dir):
    model = load_tiny(engine_models_dir, arch)
    attn = model.layers[0].self_attn
    cache = kv_cache.make_cache(model)
    ids = mx.array(list(range(100, 120)), dtype=mx.uint32)[None]
    model(ids, cache=cache)
    sinks: list[list[Any]] = [[] for _ in model.layers]
    inputs: list[Any] = []
    q_proj = attn.q_proj

    class Recorder:
        def __call__(self, x: Any) -> Any:
            inputs.append(x)
            return q_proj(x)

    attn.q_proj = Recorder()
    try:
        with captured_queries(model, sinks):
            model(mx.array([[7]], dtype=mx.uint32), cache=cache)
    finally:
        attn.q_proj = q_proj
    q = q_proj(inputs[0]).reshape(1, 1, attn.n_heads, -1)
    if hasattr(attn, "q_norm"):
        q = attn.q_norm(q)
    q = attn.rope(q.transpose(0, 2, 1, 3), offset=20)
    assert len(sinks[0]) == 1 and len(sinks[1]) == 1
    assert_close(sinks[0][0], q)


def test_rope_hooks_are_removed_even_when_the_block_fails(target):
    model, _ = target
    ropes = [layer.self_attn.rope for layer in model.layers]
    with pytest.raises(RuntimeError), mapped_positions(model, PositionPlan()):
        raise RuntimeError("boom")
    assert [layer.self_attn.rope for layer in model.layers] == ropes
    assert all(type(r).__name__ == "RoPE" for r in ropes)


def test_score_tokens_scores_the_tokens_after_the_boundary(target, draft):
    _, tok = target
    ids, end = prompt(tok, 60)
    importance = score_tokens(draft, ids, end, kv_cache.make_cache(draft), lookahead=8, pool_kernel=13)
    assert importance.shape == (len(ids) - end,)
    values = np.array(importance)
    assert np.all(np.isfinite(values)) and np.all(values >= 0) and values.max() <= 1.0
    assert values.std() > 0


# -- the engine with SpecPrefill ---------------------------------------------------------------

@pytest.fixture
def make_engine(engines, draft):
    def make(model: Any = None, draft_model: Any = draft, **options: Any) -> MLXEngine:
        options.setdefault("specprefill", SMALL)
        options.setdefault("reuse_conversation_kv", False)  # the static path, as in test_engine_batch
        return engines(model, draft_model=draft_model, **options)

    return make


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen2", "qwen3_moe"])
def test_sparse_prefill_at_keep_100_percent_equals_dense(arch, engine_models_dir, make_engine,
                                                         qwen3):
    model, tok = load_tiny(engine_models_dir, arch), qwen3
    draft_model = load_tiny(engine_models_dir, arch, draft=True)
    engine = make_engine(model, draft_model,
                         specprefill=SpecPrefillConfig(keep_pct=1.0, threshold=0))
    ids, end = prompt(tok, 50)
    for _ in range(2):                             # cold, then with the static KV restored
        events = run(engine, ids, end, max_tokens=4)
        info = events[0].prefill
        assert info.mode == "specprefill" and info.kept_tokens == len(ids) - end
        tokens = [e.token for e in events]
        for k, event in enumerate(events):        # decode continues at the full prompt length
            assert_close(event.logprobs, dense_logprobs(model, ids + tokens[:k]))
    assert info.reused_tokens == end


def expected_kept(draft: Any, ids: list[int], end: int, config: SpecPrefillConfig) -> list[int]:
    importance = score_tokens(draft, ids, end, kv_cache.make_cache(draft),
                              lookahead=config.lookahead, pool_kernel=config.pool_kernel)
    return [end + i for i in select_chunks(importance, config.keep_pct, config.chunk_size,
                                           config.tail_tokens)]


def test_sparse_prefill_equals_the_masked_dense_reference_and_protects_the_static_part(
        target, draft, make_engine):
    model, tok = target
    engine = make_engine(specprefill=SpecPrefillConfig(keep_pct=0.1, threshold=0, chunk_size=8,
                                                       tail_tokens=8))
    ids, end = prompt(tok, 120)
    kept = expected_kept(draft, ids, end, engine.specprefill)
    n = len(ids)
    assert len(kept) < (n - end) // 3 and kept[-1] == n - 1
    visible = [i < end or i in set(kept) for i in range(n)]
    for cold in (True, False):
        events = run(engine, ids, end, max_tokens=3)
        info = events[0].prefill
        assert info.mode == "specprefill" and info.kept_tokens == len(kept)
        # Every protected token [0, end) is prefilled (or restored), never sparsified.
        assert info.prefilled_tokens == (end if cold else 0) + len(kept)
        assert info.reused_tokens == (0 if cold else end)
        tokens = [e.token for e in events]
        for k, event in enumerate(events):
            # Generated tokens sit at n, n+1, ...: the full prompt length, not the kept count.
            want = masked_logprobs(model, ids + tokens[:k], visible + [True] * k)
            assert_close(event.logprobs, want)
    dense = dense_logprobs(model, ids)
    assert mx.abs(events[0].logprobs - dense).max().item() > 10 * ATOL  # sparsity is real


def test_a_sparse_request_batched_with_dense_ones_keeps_its_positions(target, draft, make_engine):
    import threading

    model, tok = target
    engine = make_engine(specprefill=SpecPrefillConfig(keep_pct=0.2, threshold=60, chunk_size=8,
                                                       tail_tokens=8))
    long_ids, end = prompt(tok, 100)
    kept = set(expected_kept(draft, long_ids, end, engine.specprefill))
    requests = [GenerationRequest(ids, max_tokens=3, specprefill_system_end=e, return_logprobs=True)
                for ids, e in (prompt(tok, 5), (long_ids, end), prompt(tok, 20))]
    results: dict[str, list[Any]] = {r.request_id: [] for r in requests}
    done = threading.Semaphore(0)

    def deliver(event: Any) -> None:
        results[event.request_id].append(event)
        if event.finish_reason:
            done.release()

    for r in requests:
        engine.submit(r, deliver)
    for _ in requests:
        assert done.acquire(timeout=60)
    modes = [results[r.request_id][0].prefill.mode for r in requests]
    assert modes == ["dense", "specprefill", "dense"]
    for r in requests:
        ids = list(r.prompt_ids)
        events = results[r.request_id]
        tokens = [e.token for e in events]
        for k, event in enumerate(events):
            if r.request_id == requests[1].request_id:
                visible = [i < end or i in kept for i in range(len(ids))] + [True] * k
                want = masked_logprobs(model, ids + tokens[:k], visible)
            else:
                want = dense_logprobs(model, ids + tokens[:k])
            assert_close(event.logprobs, want)


def extend(tok: Any, ids: list[int], user_words: int) -> list[int]:
    """The next turn of the conversation ``ids`` (which ends in the assistant header)."""
    return ids + tok.encode("Noted.<|im_end|>\n<|im_start|>user\n"
                            + " ".join(f"more{i}" for i in range(user_words))
                            + "<|im_end|>\n<|im_start|>assistant\n")


def test_the_threshold_counts_only_what_the_conversation_store_leaves(target, make_engine):
    model, tok = target
    first, end = prompt(tok, 20)
    second = extend(tok, first, 10)
    threshold = len(first) - end               # the first turn is dense, the second is not...
    assert len(second) - end > threshold >= len(second) - len(first) + 1   # ...after the boundary
    engine = make_engine(reuse_conversation_kv=True, specprefill=SpecPrefillConfig(
        threshold=threshold, chunk_size=8, tail_tokens=8))
    done = run(engine, first, end)
    assert done[0].prefill.mode == "dense"
    events = run(engine, second, end)
    info = events[0].prefill
    # Restored from the first turn, the new turn is left: dense, not SpecPrefill over the whole
    # conversation after the boundary.
    shared = restored_from(first, done, second)
    assert info.mode == "dense" and info.conversation_tokens == shared
    assert info.prefilled_tokens == len(second) - shared
    assert_close(events[0].logprobs, dense_logprobs(model, second))


def test_specprefill_after_a_restored_conversation_protects_all_of_it(target, draft, make_engine):
    model, tok = target
    config = SpecPrefillConfig(keep_pct=0.1, threshold=40, chunk_size=8, tail_tokens=8)
    engine = make_engine(reuse_conversation_kv=True, specprefill=config)
    first, end = prompt(tok, 50)
    done = run(engine, first, end, specprefill=False)
    assert done[0].prefill.mode == "dense"
    second = extend(tok, first, 120)
    base = restored_from(first, done, second)  # the first prompt and what it shares of the reply
    kept = expected_kept(draft, second, base, config)
    events = run(engine, second, end)
    info = events[0].prefill
    assert info.mode == "specprefill" and info.conversation_tokens == info.reused_tokens == base
    assert info.kept_tokens == len(kept) and info.prefilled_tokens == len(kept)
    assert len(kept) < (len(second) - base) // 3
    visible = [i < base or i in set(kept) for i in range(len(second))]
    tokens = [e.token for e in events]
    for k, event in enumerate(events):
        want = masked_logprobs(model, second + tokens[:k], visible + [True] * k)
        assert_close(event.logprobs, want)
    assert engine.snapshot_stats().conversation_hits == 1


def run_dense(engine: MLXEngine, model: Any, ids: list[int], end: int,
              visible: list[bool]) -> tuple[Any, list[Any]]:
    """Run ``ids`` and check every step against the masked reference; the prefill info and
    the events."""
    events = run(engine, ids, end)
    tokens = [e.token for e in events]
    for k, event in enumerate(events):
        assert_close(event.logprobs,
                     masked_logprobs(model, ids + tokens[:k], visible + [True] * k))
    return events[0].prefill, events


def test_the_turns_after_a_specprefill_restore_its_kept_tokens(target, draft, make_engine):
    model, tok = target
    config = SpecPrefillConfig(keep_pct=0.1, threshold=40, chunk_size=8, tail_tokens=8)
    engine = make_engine(reuse_conversation_kv=True, specprefill=config)
    first, end = prompt(tok, 120)
    kept = set(expected_kept(draft, first, end, config))
    # One token: its KV is stored from the finished response's cache (the later turns, running
    # on, store theirs from the batch).
    done = run(engine, first, end, max_tokens=1)
    assert done[0].prefill.mode == "specprefill"
    seen = len(first) - 1                      # where the first turn's sparse part ends

    def visible(ids: list[int]) -> list[bool]:
        # The kept tokens of the first turn stand for all of it; everything after is dense.
        return [i < end or i in kept or i >= seen for i in range(len(ids))]

    second = extend(tok, first, 5)             # a short turn: restored + dense, no SpecPrefill
    info, events = run_dense(engine, model, second, end, visible(second))
    shared = restored_from(first, done, second)  # turn 1's prompt, what it shares of its reply
    assert info.mode == "dense" and info.conversation_tokens == shared
    assert info.prefilled_tokens == len(second) - shared
    third = extend(tok, second, 5)             # and the turn after that restores the second's
    info, _ = run_dense(engine, model, third, end, visible(third))
    assert info.mode == "dense"
    assert info.conversation_tokens == restored_from(second, events, third)
    # A sibling of the first turn, sharing only part of its sparse history, restores that part.
    cut = seen - 20
    sibling = first[:cut] + tok.encode(" a different ending<|im_end|>\n<|im_start|>assistant\n")
    info, _ = run_dense(engine, model, sibling, end, [i < end or i in kept or i >= cut
                                                     for i in range(len(sibling))])
    assert info.mode == "dense" and info.conversation_tokens == cut


def test_a_request_with_specprefill_off_restores_only_the_dense_part_of_a_sparse_history(
        target, make_engine):
    model, tok = target
    engine = make_engine(reuse_conversation_kv=True, specprefill=SMALL)
    first, end = prompt(tok, 120)
    middle, _ = prompt(tok, 60)               # a dense turn: its prompt stored whole
    assert run(engine, middle, end, specprefill=False)[0].prefill.mode == "dense"
    assert run(engine, first, end)[0].prefill.mode == "specprefill"   # restores middle's part
    second = extend(tok, first, 5)
    events = run(engine, second, end, specprefill=False)
    info = events[0].prefill
    shared = common_prefix_len(middle, first)
    assert end < shared < len(first) - 1
    # The first prompt's entry is whole up to what it restored from the dense turn, sparse
    # after it: a dense request restores only that whole part and computes all the rest.
    assert info.mode == "dense" and info.conversation_tokens == shared
    assert_matches_dense(model, second, events)


def test_a_specprefill_that_fails_at_insertion_stores_a_dense_entry(target, make_engine):
    model, tok = target
    engine = make_engine(reuse_conversation_kv=True, specprefill=SpecPrefillConfig(
        keep_pct=0.3, threshold=40, chunk_size=8, tail_tokens=8))
    real, calls = engine._insert, []

    def insert_once_failing(seq: Any, segments: Any, cache: Any) -> None:
        calls.append(len(segments[0]))
        if len(calls) == 1:
            raise MemoryError("no room for the sparse cache")
        real(seq, segments, cache)

    engine._insert = insert_once_failing        # the engine thread looks it up per call
    first, end = prompt(tok, 120)
    done = run(engine, first, end)
    info = done[0].prefill
    assert info.mode == "dense" and "MemoryError" in info.fallback and calls[0] == 1
    second = extend(tok, first, 5)             # restores the fallback's dense prompt: exact
    events = run(engine, second, end)
    assert events[0].prefill.mode == "dense"
    assert events[0].prefill.conversation_tokens == restored_from(first, done, second)
    assert_matches_dense(model, second, events)


def test_reuse_sparse_kv_off_sparsifies_the_history_again(target, make_engine):
    _, tok = target
    engine = make_engine(reuse_conversation_kv=True, reuse_sparse_kv=False, specprefill=SMALL)
    first, end = prompt(tok, 120)
    assert run(engine, first, end)[0].prefill.mode == "specprefill"
    info = run(engine, extend(tok, first, 5), end)[0].prefill
    assert info.mode == "specprefill" and info.conversation_tokens == 0


def test_specprefill_engages_only_above_the_threshold(target, make_engine):
    _, tok = target
    engine = make_engine(specprefill=SpecPrefillConfig(threshold=50, chunk_size=8, tail_tokens=8))
    short, end = prompt(tok, 10)
    long_, _ = prompt(tok, 60)
    assert len(short) - end <= 50 < len(long_) - end
    assert run(engine, short, end)[0].prefill.mode == "dense"
    assert run(engine, long_, end)[0].prefill.mode == "specprefill"
    assert run(engine, long_, end, specprefill=False)[0].prefill.mode == "dense"
    assert run(engine, short, end, specprefill_threshold=0)[0].prefill.mode == "specprefill"


def test_any_specprefill_error_falls_back_to_dense(target, make_engine, monkeypatch):
    model, tok = target
    engine = make_engine()
    ids, end = prompt(tok, 40)

    def broken(*_a: Any, **_k: Any) -> Any:
        raise RuntimeError("draft exploded")
        yield  # a step generator, as score_steps is

    monkeypatch.setattr(sparse_module, "score_steps", broken)
    events = run(engine, ids, end)
    info = events[0].prefill
    assert info.mode == "dense" and "draft exploded" in info.fallback
    assert_close(events[0].logprobs, dense_logprobs(model, ids))
    assert engine.snapshot_stats().fallbacks == 1
    assert all(type(layer.self_attn.rope).__name__ == "RoPE" for layer in model.layers)


def test_a_failure_inside_the_sparse_prefill_falls_back_with_the_model_intact(target, make_engine,
                                                                             monkeypatch):
    model, tok = target
    engine = make_engine()
    ids, end = prompt(tok, 40)
    real = sparse_module.sparse_prefill_steps

    def failing(m: Any, token_ids: Any, positions: Any, cache: Any, step: int) -> Any:
        yield from real(m, token_ids, positions[: len(positions) // 2], cache, step)
        raise MemoryError("out of memory half-way")

    monkeypatch.setattr(sparse_module, "sparse_prefill_steps", failing)
    events = run(engine, ids, end)
    assert events[0].prefill.mode == "dense" and "MemoryError" in events[0].prefill.fallback
    assert_close(events[0].logprobs, dense_logprobs(model, ids))
    monkeypatch.setattr(sparse_module, "sparse_prefill_steps", real)
    events = run(engine, ids, end)                 # the next request sparsifies normally
    assert events[0].prefill.mode == "specprefill"


def test_a_draft_with_another_vocabulary_falls_back(target, engine_models_dir, make_engine):
    from engine_adapter.testing.tiny_model import make_tiny_model

    model, tok = target
    folder = engine_models_dir / "llama3-vocab-draft"
    if not (folder / "model.safetensors").is_file():
        make_tiny_model(folder, "llama", tokenizer="llama3", hidden=32, layers=1)
    from mlx_lm.utils import load_model

    other = load_model(folder)[0]
    engine = make_engine(draft_model=other)
    ids, end = prompt(tok, 40)
    assert max(ids) >= other.args.vocab_size
    events = run(engine, ids, end)
    assert events[0].prefill.mode == "dense" and "vocabulary" in events[0].prefill.fallback
    assert_close(events[0].logprobs, dense_logprobs(model, ids))


def test_other_sequences_keep_decoding_while_a_specprefill_runs(target, make_engine):
    """A SpecPrefill advances one model chunk per engine step, between BatchGenerator steps
    (as BatchGenerator's own prefill does), so a long one does not stall running sequences; the
    RoPE swap never outlives a chunk, so their decode stays exact."""
    import threading

    model, tok = target
    engine = make_engine(prefill_step_size=8)        # small chunks: a SpecPrefill of many steps
    sparse_ids, end = prompt(tok, 80)
    dense_ids, dense_end = prompt(tok, 2)
    sparse = GenerationRequest(sparse_ids, max_tokens=2, specprefill_system_end=end,
                               return_logprobs=True)
    dense = GenerationRequest(dense_ids, max_tokens=6, specprefill_system_end=dense_end,
                              specprefill=False, return_logprobs=True)
    order: list[Any] = []
    done = threading.Semaphore(0)

    def deliver(event: Any) -> None:
        order.append(event)
        if isinstance(event, BaseException) or event.finish_reason:
            done.release()

    engine.submit(sparse, deliver)                   # first in: its prefill starts first
    engine.submit(dense, deliver)
    for _ in range(2):
        assert done.acquire(timeout=60)
    assert not any(isinstance(e, BaseException) for e in order)
    ids = [e.request_id for e in order]
    first_sparse = ids.index(sparse.request_id)
    assert ids.count(dense.request_id) == 6
    assert len(ids) - 1 - ids[::-1].index(dense.request_id) < first_sparse  # all 6 came first
    assert order[first_sparse].prefill.mode == "specprefill"
    dense_events = [e for e in order if e.request_id == dense.request_id]
    tokens = [e.token for e in dense_events]
    for k, event in enumerate(dense_events):
        assert_close(event.logprobs, dense_logprobs(model, dense_ids + tokens[:k]))
    assert all(type(layer.self_attn.rope).__name__ == "RoPE" for layer in model.layers)
