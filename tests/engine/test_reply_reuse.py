"""The engine keeps the KV of what it generated (issue 43; engine option ``reuse_reply_kv``, off
by default): a dense sequence that finishes stores its prompt and its reply as one conversation
entry, so the next prompt that sends the
reply back restores up to where its ids part from the generated ones; every decode step then
equals an uncached dense run. A reply the client edited reuses only the common part; a
SpecPrefilled or cancelled sequence stores no reply."""

from __future__ import annotations

import pytest

pytest.importorskip("mlx.core")

from tests.support.engine_fixtures import assert_matches_dense, run, turn  # noqa: E402

REPLY = 12


def next_prompt(tok, ids: list[int], reply: list[int], user: str) -> list[int]:
    return ids + reply + tok.encode(f"<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n"
                                    "<|im_start|>assistant\n")


def test_the_next_turn_reuses_the_prompt_and_the_reply(engines, target):
    model, tok = target
    engine = engines(reuse_reply_kv=True)
    ids, end = turn(tok, 12, "List the files.")
    first = run(engine, ids, end, max_tokens=REPLY)
    reply = [e.token for e in first]
    assert len(reply) == REPLY and first[-1].finish_reason == "length"
    second = next_prompt(tok, ids, reply, "And the dirs?")
    events = run(engine, second, end, max_tokens=4)
    # All of the prompt and all of the reply but its last token (sampled, never fed).
    assert events[0].prefill.conversation_tokens == len(ids) + REPLY - 1
    assert_matches_dense(model, second, events)


def test_an_edited_reply_reuses_only_the_common_part(engines, target):
    model, tok = target
    engine = engines(reuse_reply_kv=True)
    ids, end = turn(tok, 12, "Name three files.")
    reply = [e.token for e in run(engine, ids, end, max_tokens=REPLY)]
    edited = reply[:5] + [t + 1 for t in reply[5:]]      # the client changed the rest
    second = next_prompt(tok, ids, edited, "Thanks.")
    events = run(engine, second, end, max_tokens=4)
    assert events[0].prefill.conversation_tokens == len(ids) + 5
    assert_matches_dense(model, second, events)


def test_a_specprefilled_or_cancelled_sequence_stores_no_reply(engines, target, draft):
    from engine_adapter.mlx_engine import GenerationRequest
    from engine_adapter.mlx_engine.specprefill import SpecPrefillConfig

    model, tok = target
    engine = engines(draft_model=draft, reuse_reply_kv=True,
                     specprefill=SpecPrefillConfig(keep_pct=0.5, threshold=0))
    ids, end = turn(tok, 12, "a question with enough words to be worth sparsifying " * 3)
    sparse = run(engine, ids, end, max_tokens=REPLY)
    assert sparse[0].prefill.mode == "specprefill"
    second = next_prompt(tok, ids, [e.token for e in sparse], "more?")
    events = run(engine, second, end, max_tokens=2, specprefill=False)
    assert events[0].prefill.conversation_tokens <= len(ids) - 1   # its prompt at most
    other, other_end = turn(tok, 12, "Cancel me.")
    stream = engine.generate(GenerationRequest(other, max_tokens=50,
                                               specprefill_system_end=other_end,
                                               specprefill=False))
    got = [next(stream).token for _ in range(5)]
    stream.close()                                                # cancelled mid-reply
    later = run(engine, next_prompt(tok, other, got, "?"), other_end, max_tokens=2,
                specprefill=False)
    assert later[0].prefill.conversation_tokens <= len(other) - 1


def test_off_by_default_the_next_turn_reuses_the_prompt_only(engines, target):
    from engine_adapter.options import EngineOptions

    assert EngineOptions.parse({}).engine_kwargs()["reuse_reply_kv"] is False
    assert EngineOptions.parse({"reuse_reply_kv": True}).engine_kwargs()["reuse_reply_kv"]
    model, tok = target
    engine = engines()
    ids, end = turn(tok, 12, "List the files.")
    reply = [e.token for e in run(engine, ids, end, max_tokens=REPLY)]
    events = run(engine, next_prompt(tok, ids, reply, "And the dirs?"), end, max_tokens=2)
    assert events[0].prefill.conversation_tokens == len(ids) - 1
