"""The model families whose caches are not all plain KV: Gemma 3 and gpt-oss (sliding-window
layers), Qwen3-Next and Qwen3.5 (recurrent gated DeltaNet layers beside full attention), and
Qwen3-MoE as the plain-KV MoE control. Each reuses its static prefix and its conversation; every
decode step equals an uncached dense forward, cold and restored, batched with other requests;
SpecPrefill is refused with a reason where skipping tokens would not be exact."""

from __future__ import annotations

import threading
from typing import Any

import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

from engine_adapter.mlx_engine import (  # noqa: E402
    GenerationRequest,
    MLXEngine,
)
from engine_adapter.mlx_engine.kv import cache as kv_cache  # noqa: E402
from engine_adapter.mlx_engine.engine import UNSUPPORTED_LAYERS  # noqa: E402
from engine_adapter.mlx_engine.kv.layered import supports_layered_cache  # noqa: E402
from engine_adapter.mlx_engine.model_info import context_length, vocab_size  # noqa: E402
from engine_adapter.mlx_engine.specprefill import SpecPrefillConfig  # noqa: E402
from engine_adapter.testing.tiny_model import FAMILIES, TINY_WINDOW  # noqa: E402
from tests.support.engine_fixtures import (  # noqa: E402
    assert_matches_dense,
    load_tiny,
    next_turn,
    restored_from,
    run,
    turn,
)


LAYERED = [f for f in FAMILIES if f != "qwen3_moe"]   # sliding-window or recurrent layers


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, engine_models_dir, qwen3) -> tuple[str, Any, Any]:
    return request.param, load_tiny(engine_models_dir, request.param), qwen3


def run_together(engine: MLXEngine, requests: list[GenerationRequest]) -> dict[str, list[Any]]:
    """Submit every request at once (admitted in one loop: prefilled and decoded as a batch);
    each one's events."""
    results: dict[str, list[Any]] = {r.request_id: [] for r in requests}
    done = threading.Event()
    lock = threading.Lock()

    def deliver(event: Any) -> None:
        assert not isinstance(event, BaseException), event
        with lock:
            results[event.request_id].append(event)
            if all(evs and evs[-1].finish_reason for evs in results.values()):
                done.set()

    for request in requests:
        engine.submit(request, deliver)
    assert done.wait(120)
    return results


def test_the_families_caches_are_reused(family):
    arch, model, tok = family
    assert kv_cache.supports_reuse(model)
    assert kv_cache.supports_positioned_cache(model) == (arch == "qwen3_moe")
    # Read through Qwen3.5's nested text_config too: requests are validated against them.
    assert vocab_size(model) == len(tok)
    # (mlx-lm's gpt-oss ModelArgs have no max_position_embeddings: no window known)
    assert context_length(model) == (None if arch == "gpt_oss" else 32768)


def test_static_prefix_restored_batched_with_others_matches_dense(family):
    arch, model, tok = family
    with MLXEngine(model, reuse_conversation_kv=False, max_batch_size=8,
                   prefill_batch_size=8) as engine:
        first, end = turn(tok, 12, "What is in the workspace?")
        assert end > TINY_WINDOW                   # the static prefix passes the window
        cold = run(engine, first, end)
        assert cold[0].prefill.reused_tokens == 0
        assert_matches_dense(model, first, cold)
        prompts = [turn(tok, 12, "Now list every file, recursively, with sizes."),
                   turn(tok, 12, "short"),
                   turn(tok, 5, "another static part, computed cold beside them"),
                   turn(tok, 12, "a different tenant")]
        requests = [GenerationRequest(ids, max_tokens=4, specprefill_system_end=e,
                                      return_logprobs=True,
                                      namespace="other" if i == 3 else "default")
                    for i, (ids, e) in enumerate(prompts)]
        results = run_together(engine, requests)
        for i, request in enumerate(requests):
            events = results[request.request_id]
            assert len(events) == 4
            assert events[0].prefill.reused_tokens == (end if i < 2 else 0), arch
            assert_matches_dense(model, list(request.prompt_ids), events)


def test_conversation_restored_batched_with_others_matches_dense(family):
    arch, model, tok = family
    with MLXEngine(model, max_batch_size=8, prefill_batch_size=8) as engine:
        first, end = turn(tok, 12, "What is in the workspace?")
        done = run(engine, first, end)
        second = next_turn(tok, first, "A README and a src folder.", "Open the README.")
        third = next_turn(tok, second, "It says hello.", "Thanks, and now the src folder?")
        other, other_end = turn(tok, 3, "an unrelated cold request")
        requests = [GenerationRequest(ids, max_tokens=4, specprefill_system_end=e,
                                      return_logprobs=True)
                    for ids, e in ((second, end), (other, other_end))]
        results = run_together(engine, requests)
        warm = results[requests[0].request_id]
        info = warm[0].prefill
        # A plain-KV entry serves what the next prompt shares of turn 1's reply too; a layered
        # one only whole (the client sent another reply back): turn 1's prompt.
        want = restored_from(first, done, second) if arch == "qwen3_moe" else len(first) - 1
        assert info.reused_tokens == info.conversation_tokens == want, arch
        assert_matches_dense(model, second, warm)
        assert_matches_dense(model, other, results[requests[1].request_id])
        later = run(engine, third, end, max_tokens=4)      # restores turn 2, taken at its end
        want = (restored_from(second, warm, third) if arch == "qwen3_moe"
                else len(second) - 1)
        assert later[0].prefill.conversation_tokens == want
        assert_matches_dense(model, third, later)


@pytest.mark.parametrize("arch", LAYERED)
def test_a_sibling_sharing_part_of_a_state_snapshot_uses_the_static_prefix(
        arch, engine_models_dir, qwen3):
    # A recurrent state or a window stands for exactly the tokens it was taken at: a prompt
    # that shares only part of a stored one restores the static prefix instead.
    model, tok = load_tiny(engine_models_dir, arch), qwen3
    with MLXEngine(model) as engine:
        first, end = turn(tok, 12, "One question.")
        run(engine, first, end)
        sibling = next_turn(tok, first[:-3], "x", "y")
        events = run(engine, sibling, end)
        assert events[0].prefill.conversation_tokens == 0
        assert events[0].prefill.reused_tokens == end
        assert_matches_dense(model, sibling, events)


def test_a_layered_snapshot_restores_only_whole(engine_models_dir, qwen3):
    model = load_tiny(engine_models_dir, "qwen3_next")
    cache = kv_cache.make_cache(model)   # its full-attention layers: PositionedKVCache
    assert any(isinstance(c, kv_cache.PositionedKVCache) for c in cache)
    model(mx.array(qwen3.encode("a few tokens of a prompt"))[None], cache=cache)
    n = kv_cache.cache_size(cache)
    snap = kv_cache.snapshot(cache, n)
    assert not snap.trimmable and snap.prompt_tokens == n and snap.nbytes > 0
    assert [type(c) for c in kv_cache.restore(snap)] == [type(c) for c in cache]
    with pytest.raises(ValueError, match="exactly"):
        kv_cache.restore(snap, n - 1)
    with pytest.raises(ValueError, match="sparse"):
        kv_cache.snapshot(cache, n, positions=range(n))


@pytest.mark.parametrize("arch", LAYERED)
def test_specprefill_is_refused_with_a_reason_and_the_answer_is_dense(
        arch, engine_models_dir, qwen3):
    model, tok = load_tiny(engine_models_dir, arch), qwen3
    draft = load_tiny(engine_models_dir, "qwen3", draft=True)
    config = SpecPrefillConfig(keep_pct=0.3, threshold=0)
    with MLXEngine(model, draft_model=draft, specprefill=config) as engine:
        ids, end = turn(tok, 6, "a long question " * 10)
        events = run(engine, ids, end, specprefill=True)
        assert events[0].prefill.mode == "dense"
        assert events[0].prefill.fallback == UNSUPPORTED_LAYERS
        assert_matches_dense(model, ids, events)
        off = run(engine, ids, end, specprefill=False)   # not asked for: no reason given
        assert off[0].prefill.fallback is None


def test_which_cache_mixes_are_kept():
    from mlx_lm.models.cache import ArraysCache, ChunkedKVCache, KVCache, RotatingKVCache

    assert supports_layered_cache([RotatingKVCache(8), KVCache()])
    assert supports_layered_cache([ArraysCache(2), KVCache()])
    # No attention layer to count tokens off; a cache type a snapshot does not know.
    assert not supports_layered_cache([ArraysCache(2), ArraysCache(2)])
    assert not supports_layered_cache([ChunkedKVCache(8), KVCache()])


REAL_TEMPLATES = {"qwen3_5": ("qwen3.5", "Qwen3.5-4B"), "gpt_oss": ("gpt-oss", "openai-gpt-oss-120b")}


@pytest.mark.parametrize("arch", sorted(REAL_TEMPLATES))
def test_real_template_and_tokenizer_turn_two_reuses_and_matches_dense(arch, tmp_path):
    # The family's own tokenizer and chat template (from the conformance folder), the boundary
    # from StaticPrefixCache, as a served request gets them: turn 2 restores at least the
    # static system+tools block, and every step equals dense.
    from mlx_lm.utils import load_model

    from engine_adapter.testing.tiny_model import make_tiny_model
    from prefix_cache import StaticPrefixCache
    from prefix_cache.model_folders.model_dir import load_tokenizer
    from tests.support.paths import TEMPLATES_DIR
    from tests.support.tools import make_tools

    tokenizer, stem = REAL_TEMPLATES[arch]
    template = TEMPLATES_DIR / f"{stem}.jinja"
    if not template.is_file():
        pytest.skip(f"no {template}")
    folder = make_tiny_model(tmp_path / arch, arch, tokenizer=tokenizer,
                             chat_template=template.read_text("utf-8"))
    model, tok = load_model(folder)[0], load_tokenizer(folder)
    tools = make_tools(4)
    first = [{"role": "system", "content": "You are the on-call agent."},
             {"role": "user", "content": "Why did the nightly job fail?"}]
    second = first + [{"role": "assistant", "content": "The migration timed out."},
                      {"role": "user", "content": "Retry it with a longer timeout."}]
    cache = StaticPrefixCache()
    with MLXEngine(model) as engine:
        for messages in (first, second):
            r = cache.resolve(tok, messages, tools)
            events = run(engine, r.prompt_ids, r.specprefill_system_end)
            assert_matches_dense(model, r.prompt_ids, events)
        assert r.specprefill_system_end > TINY_WINDOW
        assert events[0].prefill.reused_tokens >= r.specprefill_system_end


@pytest.mark.parametrize("arch", ["gemma3_text", "qwen3_next"])
def test_concurrent_misses_on_one_static_prefix_compute_it_once(arch, engine_models_dir, qwen3):
    model, tok = load_tiny(engine_models_dir, arch), qwen3
    with MLXEngine(model, reuse_conversation_kv=False) as engine:
        prompts = [turn(tok, 20, f"question {i} " * (i + 1)) for i in range(3)]
        end = prompts[0][1]
        requests = [GenerationRequest(ids, max_tokens=2, specprefill_system_end=end,
                                      return_logprobs=True) for ids, _ in prompts]
        results = run_together(engine, requests)
        reused = sorted(results[r.request_id][0].prefill.reused_tokens for r in requests)
        assert reused == [0, end, end]
        assert engine.kv_store.stats.puts == 1 and engine.snapshot_stats().parked == 2
        for r in requests:
            assert_matches_dense(model, list(r.prompt_ids), results[r.request_id])
