"""SpecPrefill on the families with sliding-window or recurrent layers (opt-in,
``SpecPrefillConfig.hybrid``): keep-100% equals dense at every decode step, the static prefix
stays exact (what it stores restores to the dense answer), a sparse state is never stored as a
conversation, and the option is off by default."""

from __future__ import annotations

import math
from typing import Any

import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

from engine_adapter.mlx_engine import MLXEngine  # noqa: E402
from engine_adapter.mlx_engine.specprefill import SpecPrefillConfig  # noqa: E402
from engine_adapter.testing.tiny_model import FAMILIES, TINY_WINDOW  # noqa: E402
from tests.support.engine_fixtures import (  # noqa: E402
    assert_matches_dense,
    load_tiny,
    next_turn,
    run,
    turn,
)

LAYERED = [f for f in FAMILIES if f != "qwen3_moe"]
QUESTION = "a long question about the files in the workspace and their sizes " * 6


@pytest.fixture(scope="module")
def draft(engine_models_dir: Any) -> Any:
    return load_tiny(engine_models_dir, "qwen3", draft=True)


def kl_first_step(model: Any, ids: list[int], events: list[Any]) -> float:
    """KL(dense || served) of the first token's distribution."""
    from engine_adapter.testing.reference import dense_logprobs

    dense = dense_logprobs(model, ids)
    return float((mx.exp(dense) * (dense - events[0].logprobs)).sum().item())


@pytest.mark.parametrize("arch", LAYERED)
def test_keep_all_is_the_dense_answer(arch, engine_models_dir, qwen3, draft):
    model = load_tiny(engine_models_dir, arch)
    config = SpecPrefillConfig(keep_pct=1.0, threshold=0, hybrid=True)
    with MLXEngine(model, draft_model=draft, specprefill=config) as engine:
        ids, end = turn(qwen3, 12, QUESTION)
        assert len(ids) - end > 2 * TINY_WINDOW     # the sparse part passes the window
        events = run(engine, ids, end, max_tokens=4)
        assert events[0].prefill.mode == "specprefill", events[0].prefill
        assert_matches_dense(model, ids, events)


@pytest.mark.parametrize("arch", LAYERED)
def test_sparse_keeps_the_static_prefix_exact_and_stores_no_sparse_state(
        arch, engine_models_dir, qwen3, draft):
    model = load_tiny(engine_models_dir, arch)
    config = SpecPrefillConfig(keep_pct=0.3, threshold=0, chunk_size=8, tail_tokens=8,
                               hybrid=True)
    with MLXEngine(model, draft_model=draft, specprefill=config) as engine:
        ids, end = turn(qwen3, 12, QUESTION)
        sparse = run(engine, ids, end)
        info = sparse[0].prefill
        assert info.mode == "specprefill" and info.kept_tokens < len(ids) - end
        assert math.isfinite(kl_first_step(model, ids, sparse))
        # The static prefix it computed was stored whole: a dense request restores it and
        # gets the dense answer.
        other, other_end = turn(qwen3, 12, "short")
        assert other_end == end
        dense = run(engine, other, other_end, specprefill=False)
        assert dense[0].prefill.reused_tokens == end
        assert_matches_dense(model, other, dense)
        # The next turn of the sparse prompt finds no conversation entry of it (a sparse state
        # is not a prompt's own): it restores the static prefix only, and is dense-exact.
        follow = next_turn(qwen3, ids, "a reply", "and now?")
        later = run(engine, follow, end, specprefill=False)
        assert later[0].prefill.conversation_tokens == 0
        assert later[0].prefill.reused_tokens == end
        assert_matches_dense(model, follow, later)


def test_the_option_is_off_by_default_and_read_from_engine_options():
    from engine_adapter.options import EngineOptions

    assert SpecPrefillConfig().hybrid is False
    assert EngineOptions.parse({}).engine_kwargs()["specprefill"].hybrid is False
    on = EngineOptions.parse({"specprefill_hybrid": True}).engine_kwargs()["specprefill"]
    assert on.hybrid is True


@pytest.mark.parametrize("arch", LAYERED)
def test_a_sparse_cache_decodes_at_the_full_prompt_length(arch, engine_models_dir):
    """After a sparse prefill (the last window kept), ``rotate_ahead`` and the batch's merge,
    the next token's logits are those of one forward over the kept tokens and the last one at
    their own positions: full-attention rows rotated ahead, windows as dense ones."""
    import random

    from engine_adapter.mlx_engine.kv import cache as kv_cache
    from engine_adapter.mlx_engine.prefill import PositionPlan, run_steps, sparse_prefill_steps
    from engine_adapter.mlx_engine.rope import mapped_positions

    model = load_tiny(engine_models_dir, arch)
    rng = random.Random(0)
    n = 150
    ids = [rng.randrange(1000) for _ in range(n)]
    kept = [*range(20), *range(40, 60), *range(n - 2 - TINY_WINDOW, n - 1)]
    plan = PositionPlan()
    plan.current = mx.array([*kept, n - 1], dtype=mx.int32)
    with mapped_positions(model, plan):
        want = model(mx.array([ids[p] for p in [*kept, n - 1]])[None],
                     cache=kv_cache.make_cache(model))[0, -1]
    cache = kv_cache.make_cache(model)
    run_steps(sparse_prefill_steps(model, ids, kept, cache, 16))
    batch = [c.merge([c]) for c in kv_cache.rotate_ahead(cache, n - 1)]  # as BatchGenerator
    got = model(mx.array([[ids[n - 1]]]), cache=batch)[0, -1]
    assert mx.abs(want - got).max().item() < 1e-4
