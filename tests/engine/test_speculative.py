"""Speculative decoding (prompt lookup, verified in the batch's forward) changes no output: the
same tokens, finish reasons and logprobs as plain decoding, over prompts and batch mixes, with
drafts that are accepted (repetitive, agent-like prompts) and rejected, stop tokens,
max_tokens, seeded sampling and grammars. Tiny random-weights model (float32): one engine with
speculation and one without, shared by the module."""

from __future__ import annotations

import json
import random
import threading
from typing import Any

import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

from engine_adapter.mlx_engine import GenerationRequest, MLXEngine  # noqa: E402
from engine_adapter.mlx_engine.speculative import Drafter, accepted_prefix  # noqa: E402
from tests.support.engine_fixtures import ATOL  # noqa: E402


@pytest.fixture(scope="module")
def pair(target: tuple[Any, Any]) -> Any:
    """(speculating engine, plain engine) on the tiny target; no KV reuse, so each request
    is computed the same way in both."""
    options = {"reuse_static_kv": False, "reuse_conversation_kv": False,
               "max_batch_size": 8, "prefill_batch_size": 8}
    on = MLXEngine(target[0], **options)
    off = MLXEngine(target[0], speculative=False, **options)
    yield on, off
    on.close()
    off.close()


def run_batch(engine: MLXEngine, requests: list[GenerationRequest]) -> list[list[Any]]:
    """Every event of ``requests``, submitted in one engine step (one batch)."""
    results: dict[str, list[Any]] = {r.request_id: [] for r in requests}
    left = threading.Semaphore(0)

    def deliver(event: Any) -> None:
        assert not isinstance(event, BaseException), event
        results[event.request_id].append(event)
        if event.finish_reason:
            left.release()

    with engine.together():
        for r in requests:
            engine.submit(r, deliver)
    for _ in requests:
        assert left.acquire(timeout=120)
    return [results[r.request_id] for r in requests]


def assert_same(a: list[Any], b: list[Any], sampled: bool = False) -> None:
    """The same events. A sampled row may part where rounding (a K+1-token forward sums in
    another order than a 1-token one, ~1e-6) moves a seeded draw across a near tie: up to
    there the tokens are the same, and there both had the same distribution."""
    ta, tb = [e.token for e in a], [e.token for e in b]
    if sampled and ta != tb:
        k = next(i for i, (x, y) in enumerate(zip(ta, tb, strict=False)) if x != y)
        assert mx.allclose(a[k].logprobs, b[k].logprobs, atol=ATOL).item()
        a, b = a[:k], b[:k]
        ta, tb = ta[:k], tb[:k]
    assert ta == tb
    assert [e.finish_reason for e in a] == [e.finish_reason for e in b]
    for x, y in zip(a, b, strict=True):
        if x.logprobs is not None or y.logprobs is not None:
            assert mx.allclose(x.logprobs, y.logprobs, atol=ATOL).item()


def agent_prompt(rng: random.Random, tok: Any) -> list[int]:
    """A prompt that quotes a 'file' and ends part way into quoting it again: drafts from it
    are accepted where the model continues the quote (a random model often loops instead)."""
    body = [rng.randrange(200, 8000) for _ in range(rng.randrange(8, 60))]
    return body * rng.randrange(1, 4) + body[:rng.randrange(1, 6)]


def cases(tok: Any, seed: int) -> list[list[GenerationRequest]]:
    """Batch mixes: 1-6 requests each, prompts repetitive or not, max_tokens varied, some
    with a stop token, some sampled with a seed."""
    rng = random.Random(seed)
    batches = []
    for b, size in enumerate((1, 2, 5, 6)):
        batch = []
        for i in range(size):
            ids = (agent_prompt(rng, tok) if rng.random() < 0.7
                   else [rng.randrange(200, 8000) for _ in range(rng.randrange(3, 30))])
            fields: dict[str, Any] = {"max_tokens": rng.randrange(1, 40),
                                      "return_logprobs": True}
            if rng.random() < 0.3:
                fields["stop_token_ids"] = [ids[rng.randrange(len(ids))]]
            if rng.random() < 0.25:
                fields.update(temperature=0.8, seed=rng.randrange(1000))
            batch.append(GenerationRequest(ids, request_id=f"c{seed}-{b}-{i}", **fields))
        batches.append(batch)
    return batches


@pytest.mark.parametrize("seed", [0, 1])
def test_speculation_gives_the_tokens_of_plain_decoding(pair, target, seed):
    on, off = pair
    accepted = on.stats.spec_decode_accepted_tokens
    for batch in cases(target[1], seed):
        for r, spec, plain in zip(batch, run_batch(on, batch), run_batch(off, batch),
                                  strict=True):
            assert_same(spec, plain, sampled=r.temperature > 0)
    # Not vacuous: drafts were verified and some were taken.
    assert on.stats.spec_decode_accepted_tokens > accepted
    assert off.stats.spec_decode_draft_tokens == 0
    stats = on.snapshot_stats()
    assert 0 < stats.spec_decode_accepted_tokens <= stats.spec_decode_draft_tokens


def test_a_stop_token_inside_an_accepted_draft_ends_the_reply_there(pair, target):
    on, off = pair
    # A loop the model continues: its own greedy reply, fed back twice, is drafted whole.
    seed = GenerationRequest([11, 22, 33, 44, 55, 66], max_tokens=24, request_id="s0")
    reply = [e.token for e in run_batch(off, [seed])[0]]
    ids = [11, 22, 33, 44, 55, 66] + reply + [11, 22, 33, 44, 55, 66]
    stop = reply[len(reply) // 2]
    for fields in ({"max_tokens": 24}, {"max_tokens": 5}, {"max_tokens": 24,
                                                           "stop_token_ids": [stop]}):
        request = GenerationRequest(ids, request_id="s1", return_logprobs=True, **fields)
        (spec,), (plain,) = run_batch(on, [request]), run_batch(off, [request])
        assert_same(spec, plain)
        assert len(spec) <= fields["max_tokens"]


def test_grammar_rows_emit_only_what_the_grammar_allows(pair, target):
    pytest.importorskip("llguidance")
    jsonschema = pytest.importorskip("jsonschema")
    from engine_adapter.grammar import GrammarCache, output_grammar
    from engine_adapter.mlx_engine.model_info import vocab_size
    from prefix_cache.engine.protocol import OutputConstraints

    model, tok = target
    schema = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                               "ok": {"type": "boolean"}},
              "required": ["color", "ok"], "additionalProperties": False}
    constraints = OutputConstraints({"type": "json_schema", "json_schema": {"name": "c",
                                                                            "schema": schema}})
    eot = [tok.convert_tokens_to_ids("<|im_end|>")]
    grammars = GrammarCache(tok, vocab_size(model), eot)
    grammar = output_grammar(constraints, None, None)
    # The prompt quotes answers, so drafts of them are proposed (and checked by the mask).
    example = tok.encode('{"color": "green", "ok": true}{"color": "blue", "ok": false}') * 3
    outputs = []
    for engine in pair:
        runs = [grammars.run(grammar), None]
        requests = [GenerationRequest(example, max_tokens=40, grammar=runs[0],
                                      request_id="g", stop_token_ids=eot, return_logprobs=True),
                    GenerationRequest(example, max_tokens=20, request_id="free")]
        outputs.append(run_batch(engine, requests))
        assert runs[0].error is None
    for spec, plain in zip(*outputs, strict=True):
        assert_same(spec, plain)
    text = tok.decode([e.token for e in outputs[0][0]], skip_special_tokens=True)
    jsonschema.validate(json.loads(text), schema)


def test_drafter_looks_up_the_latest_continuation_and_backs_off():
    d = Drafter([1, 2, 3, 9, 1, 2, 3, 7, 5, 1], ngram=3, min_ngram=2, max_draft=8)
    d.draft_len = 8
    assert d.propose(2, 8) == [3, 7, 5, 1, 2]    # (1, 2): its latest continuation, to the end
    assert d.propose(2, 2) == [3, 7]
    assert d.propose(4, 8) == []                 # (1, 4) never seen: no lookup next step
    assert not d.ready() and d.ready()
    d.verified(3, 0)                             # rejected: one step without drafting
    assert not d.ready() and d.ready()
    d.verified(3, 0)
    assert not d.ready() and not d.ready() and d.ready()
    d.verified(3, 3)                             # all taken: longer next time
    assert d.draft_len == 6 and d.ready()
    assert accepted_prefix([3, 7, 4], [3, 7]) == [3, 7, 4]
    assert accepted_prefix([3, 8, 4], [3, 7]) == [3, 8]


def test_the_counts_are_metrics_and_the_option_turns_it_off(pair):
    from engine_adapter.options import EngineOptions
    from prefix_cache.metrics.engine import engine_exposition

    on, _ = pair
    stats = on.snapshot_stats()
    text = engine_exposition("tiny", on)[0].decode()
    assert (f'prefix_cache_spec_decode_num_draft_tokens_total{{model="tiny"}} '
            f'{float(stats.spec_decode_draft_tokens)}') in text
    assert (f'prefix_cache_spec_decode_num_accepted_tokens_total{{model="tiny"}} '
            f'{float(stats.spec_decode_accepted_tokens)}') in text
    assert EngineOptions.parse({}).engine_kwargs()["speculative"] is True
    assert EngineOptions.parse({"speculative": False}).engine_kwargs()["speculative"] is False


def test_the_demo_chat_model_writes_the_same_reply_with_drafts_taken(demo_chat_dir):
    """Real weights, an agent-like prompt (rewrite a file shown): the greedy reply is the same
    with speculation and drafts are taken."""
    from mlx_lm import load

    model, tok = load(str(demo_chat_dir))
    code = "\n".join(f"def f{i}(x):\n    return x * {i} + {i % 3}\n" for i in range(6))
    ids = list(tok.apply_chat_template(
        [{"role": "user", "content": f"{code}\nRepeat this code exactly, with f2 renamed "
          "to g2. Output only the code."}], add_generation_prompt=True))
    request = GenerationRequest(ids, max_tokens=48, return_logprobs=True, request_id="demo")
    options = {"stop_token_ids": sorted(tok.eos_token_ids), "reuse_conversation_kv": False}
    with MLXEngine(model, **options) as on, \
            MLXEngine(model, speculative=False, **options) as off:
        (spec,), (plain,) = run_batch(on, [request]), run_batch(off, [request])
        assert_same(spec, plain)
        assert on.stats.spec_decode_accepted_tokens > 10
