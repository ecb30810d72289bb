"""The conversation store: a prompt restores the KV of the longest prefix it shares with an earlier
prompt of the same namespace (all of a previous turn it extends, or the shared part of a sibling)
and prefills only the rest; the answer equals a dense uncached forward; namespaces never share an
entry; the store stays within its bytes. A finished request's entry holds its prompt and its
reply (test_reply_reuse): the next turn restores all of the prompt and what it shares of the
reply."""

from __future__ import annotations


import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

from engine_adapter.mlx_engine import GenerationRequest, KVSnapshotStore, MLXEngine  # noqa: E402
from engine_adapter.testing.reference import dense_logprobs  # noqa: E402
from prefix_cache.cache.boundary import common_prefix_len  # noqa: E402
from tests.support.engine_fixtures import (  # noqa: E402
    assert_close,
    assert_matches_dense,
    load_tiny,
    next_turn,
    restored_from,
    run,
    turn,
)


@pytest.fixture
def make_engine(engines):
    return engines                                 # conversation reuse is on by default


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen2"])
def test_the_next_turn_restores_the_previous_prompt_and_matches_dense(arch, engine_models_dir,
                                                                      qwen3):
    model, tok = load_tiny(engine_models_dir, arch), qwen3
    with MLXEngine(model) as engine:
        first, end = turn(tok, 12, "What is in the workspace?")
        second = next_turn(tok, first, "A README and a src folder.", "Open the README.")
        third = next_turn(tok, second, "It says hello.", "Thanks, and now the src folder?")
        cold = run(engine, first, end)
        assert cold[0].prefill.reused_tokens == 0
        warm = run(engine, second, end, max_tokens=4)
        info = warm[0].prefill
        shared = restored_from(first, cold, second)
        assert info.reused_tokens == info.conversation_tokens == shared >= len(first) > end
        assert info.prefilled_tokens == len(second) - shared
        assert_matches_dense(model, second, warm)
        later = run(engine, third, end, max_tokens=4)   # the longest stored prefix: turn 2
        assert later[0].prefill.conversation_tokens == restored_from(second, warm, third)
        assert_matches_dense(model, third, later)
    stats = engine.snapshot_stats()                     # closed: every entry is stored
    assert stats.conversation_hits == 2
    # Each finished turn's entry (prompt and reply) supersedes its prompt's; the client sent
    # other replies back, so each turn keeps its own.
    assert stats.conversation_store.entries == 3
    assert stats.conversation_store.superseded == 3


def test_restored_prompt_kv_is_not_changed_by_its_users(make_engine, target):
    model, tok = target
    engine = make_engine()
    first, end = turn(tok, 8, "One.")
    run(engine, first, end)
    for reply in ("Two.", "Three, a longer one with more words in it."):
        other = next_turn(tok, first, reply, "Go on.")
        events = run(engine, other, end, max_tokens=6)
        # Turn 1 (all but its last token), or all of it through the previous sibling.
        assert events[0].prefill.conversation_tokens >= len(first) - 1
        assert_matches_dense(model, other, events)
    again = run(engine, first, end)                  # the same prompt: all but its last token
    assert again[0].prefill.reused_tokens == len(first) - 1
    assert_close(again[0].logprobs, dense_logprobs(model, first))


def test_a_sibling_prompt_restores_the_part_it_shares_with_an_earlier_one(make_engine, target):
    """A retried or edited last turn shares a prefix with the stored prompt without extending
    it: the first ``common`` tokens of that entry are restored (mlx_lm.server's trimming)."""
    model, tok = target
    engine = make_engine()
    first, end = turn(tok, 8, "What is in the workspace?")
    history = next_turn(tok, first, "A README and a src folder.", "Open the README, please.")
    edited = next_turn(tok, first, "A README and a src folder.", "Open the src folder instead.")
    run(engine, history, end)
    common = common_prefix_len(history, edited)
    assert len(first) < common < len(history) - 1
    events = run(engine, edited, end, max_tokens=4)
    info = events[0].prefill
    assert info.conversation_tokens == info.reused_tokens == common
    assert info.prefilled_tokens == len(edited) - common
    assert_matches_dense(model, edited, events)
    again = run(engine, history, end)                # the longer entry was only read, not cut
    assert again[0].prefill.reused_tokens == len(history) - 1
    assert_close(again[0].logprobs, dense_logprobs(model, history))


def test_a_prompt_sharing_no_more_than_the_static_prefix_uses_the_static_store(make_engine,
                                                                               target):
    model, tok = target
    engine = make_engine()
    first, end = turn(tok, 8, "One.")
    other = first[:end] + tok.encode("\n<|im_start|>user\nAnother.<|im_end|>\n"
                                     "<|im_start|>assistant\n")
    assert common_prefix_len(first, other) == end
    run(engine, first, end)
    events = run(engine, other, end)
    assert events[0].prefill.reused_tokens == end
    assert events[0].prefill.conversation_tokens == 0
    assert_matches_dense(model, other, events)


def test_conversation_reuse_never_crosses_namespaces(make_engine, target):
    model, tok = target
    conversations = KVSnapshotStore()
    engine = make_engine(conversation_store=conversations, reuse_static_kv=False)
    first, end = turn(tok, 10, "Hello.")
    second = next_turn(tok, first, "Hi.", "What can you do?")
    a1 = run(engine, first, end, namespace="tenant-a")
    b = run(engine, second, end, namespace="tenant-b")   # tenant-a's turn 1 is a prefix: not used
    assert b[0].prefill.reused_tokens == 0
    assert_matches_dense(model, second, b)
    a = run(engine, second, end, namespace="tenant-a")
    assert a[0].prefill.conversation_tokens == restored_from(first, a1, second)
    run(engine, first, end, namespace="sync")   # admitted after tenant-a's turn 2 was stored
    # Each finished turn's entry superseded its prompt's; tenant-b's is its own, untouched by
    # a's (tenant-a: turn 1 and turn 2, whose prompt does not hold turn 1's reply).
    assert conversations.stats.by_namespace == {"tenant-a": 2, "tenant-b": 1, "sync": 1}
    assert conversations.stats.superseded == 3
    assert conversations.purge("tenant-a") == 2
    assert run(engine, second, end, namespace="tenant-a")[0].prefill.reused_tokens == 0


def test_the_conversation_store_stays_within_its_byte_bound(make_engine, target):
    model, tok = target
    first, end = turn(tok, 10, "Hello.")
    probe = make_engine(reuse_static_kv=False)
    run(probe, first, end)
    probe.close()                                   # its finished entry (prompt and reply) is in
    one_entry = probe.conversation_store.nbytes
    assert one_entry > 0
    store = KVSnapshotStore(int(one_entry * 1.5))
    engine = make_engine(conversation_store=store, reuse_static_kv=False)
    for ns in ("a", "b", "c"):
        last = run(engine, first, end, namespace=ns)
        assert store.nbytes <= store.max_bytes
    assert len(store) == 1 and store.stats.evictions == 2
    second = next_turn(tok, first, "Hi.", "More, please.")
    events = run(engine, second, end, namespace="c")      # c's entry survived: reused
    assert events[0].prefill.conversation_tokens == restored_from(first, last, second)
    assert_matches_dense(model, second, events)
    engine.close()
    assert store.nbytes <= store.max_bytes
    # Turn 2's prompt evicted c's entry (it does not extend c's reply), and each finished
    # request's entry superseded its prompt's.
    assert len(store) == 1 and store.stats.evictions == 3 and store.stats.superseded == 4
    tiny = KVSnapshotStore(1)                                # nothing fits: reuse none, still right
    small = make_engine(conversation_store=tiny, reuse_static_kv=False)
    run(small, first, end)
    events = run(small, second, end)
    assert events[0].prefill.reused_tokens == 0 and len(tiny) == 0
    assert_matches_dense(model, second, events)
    small.close()
    assert tiny.stats.rejected == 4                          # two prompts, two replies


def test_off_switch(make_engine, target):
    _, tok = target
    engine = make_engine(reuse_conversation_kv=False)
    first, end = turn(tok, 8, "One.")
    run(engine, first, end)
    assert run(engine, first, end)[0].prefill.reused_tokens == end
    assert engine.snapshot_stats().conversation_store is None


@pytest.mark.parametrize("finished", [True, False])
def test_the_prompt_kv_is_stored_once_the_first_token_is_out(make_engine, target, finished):
    """The copy into the store waits for the first token: from the finished sequence's cache
    (one token: its finished entry then holds that token too) or from the running batch, and
    both hold exactly the prompt's KV."""
    model, tok = target
    engine = make_engine(reuse_static_kv=False)
    first, end = turn(tok, 8, "One.")
    second = next_turn(tok, first, "Two.", "Go on.")
    # (It is stored after the first token is delivered: the next request, admitted on the
    # engine thread after that, is the way to see it.)
    if finished:
        want = restored_from(first, run(engine, first, end, max_tokens=1), second)
    else:
        running = engine.generate(GenerationRequest(first, specprefill_system_end=end,
                                                    max_tokens=10_000))
        next(running)
        want = len(first) - 1
    events = run(engine, second, end, max_tokens=3)
    assert events[0].prefill.conversation_tokens == want
    assert_matches_dense(model, second, events)
    if not finished:
        running.close()
