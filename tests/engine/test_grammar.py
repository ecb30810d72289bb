"""Constrained decoding in the engine: grammars built from a request's output fields, compiled
once per grammar and tokenizer, and a per-sequence mask in the sampler, so constrained and free
sequences share a batch (tiny random-weights model: the output holds by the mask, not by luck)."""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")
pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from engine_adapter.grammar import GrammarCache, output_grammar  # noqa: E402
from engine_adapter.grammar.build import ENGINE_ENVELOPE, LLAMA_ENVELOPE, Envelope  # noqa: E402
from engine_adapter.mlx_engine import GenerationRequest  # noqa: E402
from engine_adapter.mlx_engine.model_info import vocab_size  # noqa: E402
from engine_adapter.mlx_engine.sampling import allowed_tokens  # noqa: E402
from engine_adapter.tool_calls import json_envelope  # noqa: E402
from prefix_cache.engine.protocol import OutputConstraints  # noqa: E402
from prefix_cache.errors import InvalidRequestError  # noqa: E402
from tests.support.engine_fixtures import assert_matches_dense, turn  # noqa: E402

SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                           "ok": {"type": "boolean"}},
          "required": ["color", "ok"], "additionalProperties": False}
JSON_SCHEMA = OutputConstraints({"type": "json_schema", "json_schema": {"name": "c",
                                                                        "schema": SCHEMA}})
TOOLS = [{"type": "function", "function": {"name": "paint", "parameters": SCHEMA}},
         {"type": "function", "function": {"name": "clear", "parameters": {
             "type": "object", "properties": {}, "additionalProperties": False}}}]


def end_of_turn(tok: Any) -> list[int]:
    return [tok.convert_tokens_to_ids("<|im_end|>")]


def grammars(model: Any, tok: Any) -> GrammarCache:
    return GrammarCache(tok, vocab_size(model), end_of_turn(tok))


def text_of(tok: Any, events: list[Any]) -> str:
    return tok.decode([e.token for e in events], skip_special_tokens=True)


def test_constrained_and_free_sequences_share_a_batch(engines, target):
    model, tok = target
    engine = engines(max_batch_size=8, prefill_batch_size=8, stop_token_ids=end_of_turn(tok))
    cache = grammars(model, tok)
    schema = output_grammar(JSON_SCHEMA, None, None)
    # Qwen's vocabulary has <tool_call> as one added token: the grammar names it by id.
    forced = output_grammar(OutputConstraints(tool_choice="required"), TOOLS,
                            json_envelope(tok))
    prompts = [turn(tok, 6, f"question {i} " * (i + 1)) for i in range(4)]
    runs = [cache.run(schema), None, cache.run(forced), None]
    requests = [GenerationRequest(ids, max_tokens=48, specprefill_system_end=end,
                                  return_logprobs=True, grammar=run)
                for (ids, end), run in zip(prompts, runs, strict=True)]
    results: dict[str, list[Any]] = {}
    done = threading.Event()
    lock = threading.Lock()

    def deliver(event: Any) -> None:
        assert not isinstance(event, BaseException), event
        with lock:
            results.setdefault(event.request_id, []).append(event)
            if sum(1 for evs in results.values() if evs[-1].finish_reason) == len(requests):
                done.set()

    for request in requests:
        engine.submit(request, deliver)
    assert done.wait(120)
    constrained_json, free_a, call, free_b = (results[r.request_id] for r in requests)
    # The grammar's output, whole, and ended by the model's end-of-turn token.
    assert constrained_json[-1].finish_reason == "stop"
    jsonschema.validate(json.loads(text_of(tok, constrained_json)), SCHEMA)
    assert call[-1].finish_reason == "stop"
    written = text_of(tok, call)
    assert written.startswith("<tool_call>") and written.endswith("</tool_call>")
    for body in written.removeprefix("<tool_call>").removesuffix("</tool_call>") \
            .split("</tool_call><tool_call>"):
        parsed = json.loads(body)
        tool = next(t["function"] for t in TOOLS if t["function"]["name"] == parsed["name"])
        jsonschema.validate(parsed["arguments"], tool["parameters"])
    assert all(r.error is None for r in runs if r is not None)
    # Every row's distribution is the model's own: the mask picks among tokens, it changes
    # no row's logits (and the free rows sample from theirs, unmasked).
    for request in requests:
        assert_matches_dense(model, list(request.prompt_ids), results[request.request_id])
    assert {len(results[r.request_id]) for r in (requests[1], requests[3])} == {48}


def test_a_grammar_compiles_once_per_schema_and_tokenizer(target, llama3, engine_models_dir):
    model, tok = target
    cache = grammars(model, tok)
    grammar = output_grammar(JSON_SCHEMA, None, None)
    first, second = cache.matcher(grammar), cache.matcher(grammar)
    assert (cache.compiles, cache.hits) == (1, 1)
    assert first is not second  # a fresh matcher per request: their states never mix
    assert first.consume_token(tok.encode("{")[0]) and not second.is_error()
    cache.matcher(output_grammar(OutputConstraints({"type": "json_object"}), None, None))
    assert cache.compiles == 2
    other = GrammarCache(llama3, len(llama3), [llama3.eos_token_id])
    other.matcher(grammar)
    assert other.compiles == 1


def test_a_loaded_backend_builds_its_grammar_tokenizer_before_the_first_request(
        engine_models_dir):
    from engine_adapter.backend import MLXBackend
    from engine_adapter.testing.tiny_model import tiny_model_folder

    backend = MLXBackend.load(tiny_model_folder(engine_models_dir / "qwen3-64x2", "qwen3"))
    try:
        cache = backend.grammars
        assert cache.tokenizer_builds == 1   # at load, not on a request
        forced = output_grammar(OutputConstraints(tool_choice="required"), TOOLS,
                                backend.envelope)
        cache.matcher(forced)
        cache.prepare()                       # again: nothing to build
        assert (cache.tokenizer_builds, cache.compiles) == (1, 1)
    finally:
        backend.close()


def test_bitmask_words_are_read_little_endian_and_cut_to_the_logits():
    words = bytes([0b00000101, 0, 0, 0b10000000])  # tokens 0, 2 and 31
    assert list(allowed_tokens(words, 33).nonzero()[0]) == [0, 2, 31]
    assert list(allowed_tokens(words, 3).nonzero()[0]) == [0, 2]


@pytest.mark.parametrize(("constraints", "tools", "named"), [
    (OutputConstraints({"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"s": {"type": "string", "pattern": "(?=a)b"}}}}}),
     None, "response_format.json_schema.schema"),
    (OutputConstraints(tool_choice="required"),
     [TOOLS[0], {"type": "function", "function": {"name": "bad", "parameters": {
         "type": "object", "properties": {"s": {"type": "string", "pattern": "(?<=a)"}}}}}],
     "tools[1].function.parameters"),
])
def test_a_schema_the_engine_cannot_compile_is_refused_naming_the_part(target, constraints,
                                                                       tools, named):
    model, tok = target
    grammar = output_grammar(constraints, tools, ENGINE_ENVELOPE)
    with pytest.raises(InvalidRequestError, match=named.replace("[", r"\[")) as refused:
        grammars(model, tok).matcher(grammar)
    assert "look-around" in str(refused.value)


@pytest.mark.parametrize(("constraints", "tools", "envelope", "message"), [
    (OutputConstraints(tool_choice="required"), None, ENGINE_ENVELOPE, "tool_choice needs tools"),
    (OutputConstraints(tool_choice={"type": "function", "function": {"name": "nope"}}), TOOLS,
     ENGINE_ENVELOPE, "'nope', which is not in tools"),
    (OutputConstraints(tool_choice="required"), TOOLS, None, "cannot be constrained"),
])
def test_tool_choices_the_engine_cannot_honour_are_refused(constraints, tools, envelope, message):
    with pytest.raises(InvalidRequestError, match=message):
        output_grammar(constraints, tools, envelope)


def test_what_each_choice_allows():
    named = output_grammar(OutputConstraints(
        tool_choice={"type": "function", "function": {"name": "clear"}},
        parallel_tool_calls=False), TOOLS, Envelope("[C]", "[/C]"))
    assert named is not None and named.calls
    assert named.lark.splitlines()[0] == "start: call" and '"clear"' in named.lark
    assert '"paint"' not in named.lark and '"[C]"' in named.lark
    auto = output_grammar(OutputConstraints(), TOOLS, ENGINE_ENVELOPE)
    assert auto is not None and auto.lark.splitlines()[0] == (
        'start: TEXT? | (OPEN | "<tool_call>") body call*')   # text, then calls
    # Llama 3.x: one bare {"name", "parameters"} call, forced; under auto its parser reads it.
    bare = output_grammar(OutputConstraints(tool_choice="required"), TOOLS, LLAMA_ENVELOPE)
    assert bare is not None and bare.lark.splitlines()[0] == "start: call"
    assert "call: args_0 | args_1" in bare.lark.splitlines()
    assert '"parameters"' in bare.lark and '"arguments"' not in bare.lark
    assert output_grammar(OutputConstraints(), TOOLS, LLAMA_ENVELOPE) is None
    # Free text with no tools, or tools whose family format is not constrained: no grammar.
    assert output_grammar(OutputConstraints(), None, ENGINE_ENVELOPE) is None
    assert output_grammar(OutputConstraints(), TOOLS, None) is None
    assert output_grammar(OutputConstraints(tool_choice="none"), TOOLS, ENGINE_ENVELOPE) is None


@pytest.mark.parametrize("envelope", ["qwen3", "text"])
def test_auto_lets_text_and_reasoning_come_before_the_calls(target, envelope):
    # A reasoning model reasons, says what it will do, then calls: the text may hold "<" but
    # never START, so once START is written the call is finished under its schema.
    model, tok = target
    env = json_envelope(tok) if envelope == "qwen3" else Envelope("[CALL]", "[/CALL]")
    assert (env.ids[0] is not None) == (envelope == "qwen3")   # one token, or plain text
    cache = grammars(model, tok)
    think = Envelope("<think>", "</think>", tuple(tok.convert_tokens_to_ids(["<think>",
                                                                            "</think>"])))
    grammar = output_grammar(OutputConstraints(), TOOLS, env, think)

    def refused_at(ids: list[int]) -> int | None:
        """The index of the first token the grammar refuses; None when it ends complete."""
        run = cache.run(grammar)
        for i, token in enumerate(ids):
            if not run.matcher.consume_token(token):
                return i
        return None if run.matcher.is_accepting() else len(ids)

    def encode(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    body = '\n{"name": "paint", "arguments": {"color": "red", "ok": true}}\n'
    start, end = (([i] for i in env.ids) if env.ids[0] is not None
                  else (encode(env.start), encode(env.end)))
    call = start + encode(body) + end
    head = encode("<think>\nIs 1 < 2? Yes.\n</think>\n\nI will paint it.\n")
    opened = encode("Is 1 < 2? Yes.\n</think>\n\n")   # the prompt opened the block
    for ids in (head, call, head + call, head + call + call, opened + call):
        assert refused_at(ids) is None
    # START inside the text starts a call: what follows must be the call's JSON.
    assert refused_at(encode("Sure. ") + start + encode(" not a call")) is not None


def test_a_model_with_no_tool_call_format_gets_calls_through_the_engines_envelope(engines,
                                                                                target):
    import asyncio

    from engine_adapter.backend import MLXBackend
    from prefix_cache.engine.protocol import BackendRequest, SamplingParams

    model, tok = target  # a transformers tokenizer: no mlx-lm tool parser, no format named
    backend = MLXBackend(engines(stop_token_ids=end_of_turn(tok)), tok)
    assert backend.envelope is not None and backend.envelope.start == "<tool_call>"
    ids, end = turn(tok, 4, "Paint it.")
    request = BackendRequest(ids, end, sampling=SamplingParams(max_tokens=48, temperature=0.0),
                             tools=TOOLS, constraints=OutputConstraints(
                                 tool_choice={"type": "function", "function": {"name": "paint"}},
                                 parallel_tool_calls=False))

    async def outputs() -> list[Any]:
        return [out async for out in backend.generate(backend.check(request))]

    outs = asyncio.run(outputs())
    chunks = [c for out in outs for c in out.tool_call_chunks]
    assert outs[-1].finish_reason == "tool_calls" and {c.index for c in chunks} == {0}
    assert [c.name for c in chunks if c.name] == ["paint"]
    jsonschema.validate(json.loads("".join(c.arguments for c in chunks)), SCHEMA)
    assert "".join(out.text for out in outs) == ""


def test_an_engine_without_constrained_decoding_refuses_binding_fields() -> None:
    from types import SimpleNamespace

    from prefix_cache.api.engine_target import EngineTarget
    from prefix_cache.chat.anthropic_params import parse_messages_body
    from prefix_cache.chat.responses_params import parse_responses_body

    plain = EngineTarget(SimpleNamespace())  # a ChatBackend that does not say it constrains
    call = parse_messages_body({"model": "m", "max_tokens": 4, "output_config": {"format": {
        "type": "json_schema", "schema": SCHEMA}}, "messages": [{"role": "user", "content": "x"}]})
    with pytest.raises(InvalidRequestError, match="^output_config.format is not supported"):
        plain.check(call, "messages")
    forced = parse_responses_body({"model": "m", "input": "x", "tool_choice": "required",
                                   "tools": [{"type": "function", "name": "f",
                                              "parameters": SCHEMA}]}, lambda _: None).call
    with pytest.raises(InvalidRequestError, match="^tool_choice is not supported"):
        plain.check(forced, "responses")
    plain.check(parse_responses_body({"model": "m", "input": "x"}, lambda _: None).call,
                "responses")  # free text: it runs
