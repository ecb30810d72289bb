"""A layer-truncated draft's work reused by the target (``draft_layers``, issue #26 part 4): the
target's low layers are the draft's dense KV at the kept positions, its upper layers run from
the draft's hidden states, and nothing of it is used unless the draft's weights are the
target's own."""

from __future__ import annotations

from typing import Any

import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

from engine_adapter.mlx_engine import MLXEngine, SpecPrefillConfig  # noqa: E402
from engine_adapter.mlx_engine.kv import cache as kv_cache  # noqa: E402
from engine_adapter.mlx_engine.draft_layers import shared_layers  # noqa: E402
from engine_adapter.mlx_engine.specprefill import score_tokens, select_chunks  # noqa: E402
from engine_adapter.testing.reference import dense_logprobs, masked_logprobs  # noqa: E402
from tests.engine.test_specprefill import prompt  # noqa: E402
from tests.support.engine_fixtures import ATOL, assert_close, load_tiny, run  # noqa: E402


def truncated(root: Any, arch: str, layers: int) -> Any:
    """A fresh copy of the tiny ``arch`` target keeping its first ``layers`` layers (what
    ``convert --layers N`` makes of a real model)."""
    model = load_tiny(root, arch)
    model.model.layers = model.model.layers[:layers]
    return model


LAYERED = SpecPrefillConfig(keep_pct=0.3, threshold=0, chunk_size=8, tail_tokens=8,
                            reuse_draft_layers=True)


def test_shared_layers_checks_the_weights(engine_models_dir: Any, target: Any) -> None:
    model = target[0]
    assert shared_layers(model, truncated(engine_models_dir, "qwen3", 1)) == 1
    assert shared_layers(model, truncated(engine_models_dir, "qwen3", 2)) == 0  # not fewer
    other = truncated(engine_models_dir, "qwen3", 1)
    other.model.layers[0].mlp.down_proj.weight = other.model.layers[0].mlp.down_proj.weight + 1e-3
    assert shared_layers(model, other) == 0                          # one weight differs
    assert shared_layers(model, load_tiny(engine_models_dir, "qwen3", draft=True)) == 0
    assert shared_layers(model, truncated(engine_models_dir, "llama", 1)) == 0   # another family


def test_asking_for_it_with_another_draft_is_an_error(engines: Any, draft: Any) -> None:
    with pytest.raises(ValueError, match="not the target's first layers"):
        engines(draft_model=draft, specprefill=LAYERED)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_at_keep_100_percent_it_is_dense(arch: str, engine_models_dir: Any, engines: Any,
                                         qwen3: Any) -> None:
    model = load_tiny(engine_models_dir, arch)
    engine = engines(model, draft_model=truncated(engine_models_dir, arch, 1),
                     reuse_conversation_kv=False,
                     specprefill=SpecPrefillConfig(keep_pct=1.0, threshold=0,
                                                   reuse_draft_layers=True))
    ids, end = prompt(qwen3, 50)
    for _ in range(2):  # cold, then with the static KV restored
        events = run(engine, ids, end, max_tokens=4)
        assert events[0].prefill.mode == "specprefill"
        tokens = [e.token for e in events]
        for k, event in enumerate(events):
            assert_close(event.logprobs, dense_logprobs(model, ids + tokens[:k]))


def test_sparse_it_equals_the_reference_with_dense_low_layers(engine_models_dir: Any,
                                                               engines: Any, qwen3: Any) -> None:
    """Kept tokens leave the draft's layer dense (they attended to the whole prompt there);
    above it they see the protected part and each other; what is decoded after sees only
    what is stored, in every layer."""
    model = load_tiny(engine_models_dir, "qwen3")
    draft_model = truncated(engine_models_dir, "qwen3", 1)
    engine = engines(model, draft_model=draft_model, reuse_conversation_kv=False,
                     specprefill=LAYERED)
    ids, end = prompt(qwen3, 120)
    importance = score_tokens(draft_model, ids, end, kv_cache.make_cache(draft_model),
                              lookahead=LAYERED.lookahead, pool_kernel=LAYERED.pool_kernel)
    kept = {end + i for i in select_chunks(importance, LAYERED.keep_pct, LAYERED.chunk_size,
                                           LAYERED.tail_tokens)}
    n = len(ids)
    visible = [i < end or i in kept for i in range(n)]
    plain = engines(model, draft_model=draft_model, reuse_conversation_kv=False,
                    specprefill=SpecPrefillConfig(keep_pct=0.3, threshold=0, chunk_size=8,
                                                  tail_tokens=8))
    for cold in (True, False):
        events = run(engine, ids, end, max_tokens=3)
        info = events[0].prefill
        assert info.mode == "specprefill" and info.kept_tokens == len(kept)
        assert info.reused_tokens == (0 if cold else end)
        tokens = [e.token for e in events]
        for k, event in enumerate(events):
            want = masked_logprobs(model, ids + tokens[:k], visible + [True] * k,
                                   dense_layers=1, dense_rows=n - 1)
            assert_close(event.logprobs, want)
    other = run(plain, ids, end, max_tokens=1)[0].logprobs  # the low layers made a difference
    assert mx.abs(events[0].logprobs - other).max().item() > 10 * ATOL


def test_its_sparse_history_serves_only_its_own_kind(engine_models_dir: Any, qwen3: Any) -> None:
    """Sparse snapshots are tagged apart (their low layers hold other KV): the next turn of a
    layered engine restores them; a plain engine sharing the store does not."""
    from engine_adapter.mlx_engine.kv.store import KVSnapshotStore
    from engine_adapter.mlx_engine.reuse import TARGET_ID

    model = load_tiny(engine_models_dir, "qwen3")
    draft_model = truncated(engine_models_dir, "qwen3", 1)
    store = KVSnapshotStore()
    ids, end = prompt(qwen3, 120)
    layered = MLXEngine(model, draft_model=draft_model, specprefill=LAYERED,
                        conversation_store=store)
    plain = MLXEngine(model, draft_model=draft_model, conversation_store=store,
                      specprefill=SpecPrefillConfig(keep_pct=0.3, threshold=0, chunk_size=8,
                                                    tail_tokens=8))
    try:
        first = run(layered, ids, end, max_tokens=2)
        assert first[0].prefill.mode == "specprefill"
        nxt = ids + [first[0].token] + qwen3.encode("<|im_end|>\n<|im_start|>user\nmore"
                                                    "<|im_end|>\n<|im_start|>assistant\n")
        _, snap = store.longest_common_prefix("default", TARGET_ID, nxt, len(nxt) - 1)
        assert snap.positions is not None and snap.keep_pct == -LAYERED.keep_pct
        mine = run(layered, nxt, end, max_tokens=1)[0].prefill
        assert mine.conversation_tokens > end       # its own sparse history, restored
        theirs = run(plain, nxt, end, max_tokens=1)[0].prefill
        assert theirs.conversation_tokens <= end    # not the layered engine's
    finally:
        layered.close()
        plain.close()


def test_the_engine_option_reaches_the_config() -> None:
    from engine_adapter.options import EngineOptions

    assert not EngineOptions.parse({}).engine_kwargs()["specprefill"].reuse_draft_layers
    options = EngineOptions.parse({"reuse_draft_layers": "true"})
    assert options.engine_kwargs()["specprefill"].reuse_draft_layers is True
