"""The engine keeps the KV of what it generated: a finished sequence's prompt and reply go to the
conversation store, so the next turn that sends the reply back restores it (up to where the
re-sent reply diverges from the generated ids, never more), and every decode step after that
equals an uncached dense forward. A cancelled sequence keeps no more than its prompt."""

from __future__ import annotations

from typing import Any

import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

from engine_adapter.mlx_engine import (  # noqa: E402
    GenerationRequest,
    KVSnapshotStore,
    MLXEngine,
    SpecPrefillConfig,
)
from engine_adapter.testing.reference import masked_logprobs  # noqa: E402
from engine_adapter.testing.tiny_model import FAMILIES  # noqa: E402
from prefix_cache.cache.boundary import common_prefix_len  # noqa: E402
from prefix_cache.metrics.engine import engine_exposition  # noqa: E402
from tests.engine.test_specprefill import expected_kept, prompt  # noqa: E402
from tests.support.engine_fixtures import (  # noqa: E402
    assert_close,
    assert_matches_dense,
    load_tiny,
    run,
    turn,
)

GENERATED = 16


def send_back(tok: Any, prompt: list[int], reply: list[int], user: str) -> list[int]:
    """The next turn: ``prompt`` (ending in the assistant header), the reply's ids as they
    were generated, then a new user turn and the header."""
    return prompt + reply + tok.encode(f"<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n"
                                       "<|im_start|>assistant\n")


def first_turn(engine: MLXEngine, tok: Any) -> tuple[list[int], int, list[int]]:
    """Turn 1 run to its length: its prompt, static end and generated ids."""
    first, end = turn(tok, 12, "What is in the workspace?")
    events = run(engine, first, end, max_tokens=GENERATED)
    assert events[-1].finish_reason == "length" and len(events) == GENERATED
    return first, end, [e.token for e in events]


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen3_moe"])
def test_turn_two_restores_the_prompt_and_the_reply_and_matches_dense(arch, engine_models_dir,
                                                                      qwen3):
    model, tok = load_tiny(engine_models_dir, arch), qwen3
    with MLXEngine(model) as engine:
        first, end, reply = first_turn(engine, tok)
        second = send_back(tok, first, reply, "Open the README.")
        events = run(engine, second, end, max_tokens=6)
        info = events[0].prefill
        assert info.reused_tokens == info.conversation_tokens == len(first) + len(reply)
        assert info.reply_tokens == len(reply)                 # all of it: >= 80% asked
        assert info.prefilled_tokens == len(second) - len(first) - len(reply)
        assert_matches_dense(model, second, events)
        stats = engine.snapshot_stats()
        assert stats.reused_generated_tokens == len(reply)
        # The finished turn's entry superseded its prompt's: one entry per conversation.
        assert stats.conversation_store.entries == 1
        text = engine_exposition("tiny", engine)[0].decode()
        assert f'prefix_cache_engine_reused_generated_tokens_total{{model="tiny"}} ' \
               f'{float(len(reply))}' in text


def test_after_a_specprefill_the_sparse_history_and_the_dense_reply_are_restored(target, draft):
    model, tok = target
    config = SpecPrefillConfig(keep_pct=0.1, threshold=40, chunk_size=8, tail_tokens=8)
    with MLXEngine(model, draft_model=draft, specprefill=config) as engine:
        first, end = prompt(tok, 120)
        kept = set(expected_kept(draft, first, end, config))
        events = run(engine, first, end, max_tokens=8)
        assert events[0].prefill.mode == "specprefill"
        reply = [e.token for e in events]
        second = send_back(tok, first, reply, "Go on.")
        events = run(engine, second, end, max_tokens=4)
        info = events[0].prefill
        assert info.mode == "dense"
        assert info.conversation_tokens == len(first) + len(reply)
        assert info.reply_tokens == len(reply)
        # The kept tokens stand for turn 1's prompt; its last token, the reply and all after
        # it are dense.
        visible = [i < end or i in kept or i >= len(first) - 1 for i in range(len(second))]
        tokens = [e.token for e in events]
        for k, event in enumerate(events):
            want = masked_logprobs(model, second + tokens[:k], visible + [True] * k)
            assert_close(event.logprobs, want)


def test_a_reply_edited_by_the_client_restores_only_the_common_part(target):
    model, tok = target
    with MLXEngine(model) as engine:
        first, end, reply = first_turn(engine, tok)
        k = GENERATED // 2
        edited_reply = reply[:k] + [t for t in tok.encode(" an edited ending") if t != reply[k]]
        assert edited_reply[k] != reply[k]
        second = send_back(tok, first, edited_reply, "Go on.")
        events = run(engine, second, end, max_tokens=6)
        info = events[0].prefill
        assert info.conversation_tokens == len(first) + k
        assert info.reply_tokens == k
        assert_matches_dense(model, second, events)
        # The reply as text, decoded and tokenized again: what matches the generated ids.
        again = first + tok.encode(tok.decode(reply) + "<|im_end|>\n<|im_start|>user\nMore."
                                   "<|im_end|>\n<|im_start|>assistant\n")
        shared = common_prefix_len(first + reply, again)
        events = run(engine, again, end, max_tokens=4)
        assert events[0].prefill.conversation_tokens == max(shared, len(first) + k)
        assert_matches_dense(model, again, events)


def test_a_cancelled_sequence_keeps_no_more_than_its_prompt(target):
    model, tok = target
    with MLXEngine(model) as engine:
        first, end = turn(tok, 12, "What is in the workspace?")
        stream = engine.generate(GenerationRequest(first, specprefill_system_end=end,
                                                   max_tokens=200))
        reply = [next(stream).token for _ in range(4)]
        stream.close()                                   # cancels it
        second = send_back(tok, first, reply, "Go on.")
        events = run(engine, second, end)
        info = events[0].prefill
        assert info.conversation_tokens == len(first) - 1 and info.reply_tokens == 0
        assert_matches_dense(model, second, events)
        assert engine.snapshot_stats().reused_generated_tokens == 0


def test_a_reply_too_big_for_the_store_is_not_kept_and_the_turn_is_computed(target):
    model, tok = target
    probe = KVSnapshotStore()
    with MLXEngine(model, conversation_store=probe) as engine:
        first, end, _ = first_turn(engine, tok)
    per_token = probe.nbytes // (len(first) + GENERATED)   # closed: the reply is stored
    # Room for the prompt's entry, not for the prompt and its reply.
    store = KVSnapshotStore(max_bytes=per_token * (len(first) - 1 + GENERATED // 2))
    with MLXEngine(model, conversation_store=store) as engine:
        first, end, reply = first_turn(engine, tok)
        second = send_back(tok, first, reply, "Go on.")
        events = run(engine, second, end)  # (admitted after turn 1's reply was offered)
        assert store.snapshot_stats().rejected >= 1
        assert events[0].prefill.conversation_tokens == len(first) - 1
        assert events[0].prefill.reply_tokens == 0
        assert_matches_dense(model, second, events)


@pytest.mark.parametrize("arch", [f for f in FAMILIES if f != "qwen3_moe"])
def test_layered_families_restore_the_reply_whole_and_match_dense(arch, engine_models_dir,
                                                                  qwen3):
    # A window or a recurrent state is snapshotted at the sequence's end: a next prompt that
    # holds all of the reply restores it; one that changes it restores the prompt's entry.
    model, tok = load_tiny(engine_models_dir, arch), qwen3
    with MLXEngine(model) as engine:
        first, end, reply = first_turn(engine, tok)
        edited = send_back(tok, first, reply[:-1] + [t for t in tok.encode(" x")
                                                     if t != reply[-1]], "Go on.")
        events = run(engine, edited, end, max_tokens=4)
        assert events[0].prefill.conversation_tokens == len(first) - 1, arch
        assert_matches_dense(model, edited, events)
        second = send_back(tok, first, reply, "Open the README.")
        events = run(engine, second, end, max_tokens=4)
        info = events[0].prefill
        assert info.conversation_tokens == len(first) + len(reply), arch
        assert info.reply_tokens == len(reply)
        assert_matches_dense(model, second, events)


def test_the_off_switch_keeps_the_prompt_only(target):
    model, tok = target
    with MLXEngine(model, reuse_reply_kv=False) as engine:
        first, end, reply = first_turn(engine, tok)
        second = send_back(tok, first, reply, "Go on.")
        events = run(engine, second, end)
        info = events[0].prefill
        assert info.conversation_tokens == len(first) - 1 and info.reply_tokens == 0
        assert_matches_dense(model, second, events)
