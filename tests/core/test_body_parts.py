"""``fastpath.parse_body`` answers exactly as ``json_io.loads`` of the whole body (the same
value, or the same error) whatever the bytes, and what it remembers of a part (its key
material, its value) is only ever what those exact bytes parse to, in the scope that sent them."""

from __future__ import annotations

import json
import random
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefix_cache.util import json_io
from prefix_cache.cache import keys
from prefix_cache.errors import InvalidRequestError
from prefix_cache.fastpath import REMEMBERED_BYTES, FastKeyPacker, KnownParts, PartMemo, parse_body
from prefix_cache.util.token_ids import TokenIds, checked_token_ids

PAD = "x" * REMEMBERED_BYTES  # makes a part large enough to be remembered
TOOLS = [{"type": "function", "function": {"name": f"tool_{i}", "description": PAD,
                                           "parameters": {"type": "object", "properties": {
                                               "n": {"type": "integer", "maximum": 2**40}}}}}
         for i in range(3)]
SYSTEM = {"role": "system", "content": "You are terse. " + PAD}


def whole(raw: bytes) -> tuple[str, Any]:
    try:
        return "ok", json_io.loads(raw)
    except json_io.JSONInputError as exc:
        return "error", (str(exc), exc.code)


def parts(raw: bytes, memo: PartMemo, scope: str = "t", share: bool = False) -> tuple[str, Any]:
    try:
        return "ok", parse_body(raw, memo, scope, share)[0]
    except json_io.JSONInputError as exc:
        return "error", (str(exc), exc.code)


def same(raw: bytes, memo: PartMemo | None = None, share: bool = False) -> Any:
    """parse_body agrees with json_io.loads, first sight and again (remembered)."""
    memo = memo if memo is not None else PartMemo()
    expected = whole(raw)
    for _ in range(3):
        got = parts(raw, memo, share=share)
        assert got[0] == expected[0]
        if got[0] == "ok":  # equal, and in the same types and key order (repr tells 1 from 1.0)
            assert repr(got[1]) == repr(expected[1])
        else:
            assert got[1] == expected[1]
    return expected[1]


def body(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [SYSTEM, {"role": "user", "content": "hi"}],
            "tools": TOOLS, **fields}


@pytest.mark.parametrize("dump", [
    orjson.dumps,
    lambda v: json.dumps(v).encode(),                       # ", " and ": " separators
    lambda v: json.dumps(v, indent=2).encode(),             # newlines everywhere
    lambda v: json.dumps(v, ensure_ascii=True).encode(),    # escapes inside strings
    lambda v: b"\r\n\t " + json.dumps(v, indent="\t").encode() + b" \n",
])
def test_same_value_in_any_layout(dump: Any) -> None:
    same(dump(body()))
    same(dump(body(prompt_ids=list(range(500)))))


@pytest.mark.parametrize("raw", [
    # a duplicate key: the last value wins in both, and the dropped one is still checked
    b'{"tools": [1e999], "tools": [], "pad": "%s"}',
    b'{"tools": ["\xff"], "tools": [], "pad": "%s"}',
    b'{"tools": [], "tools": [1], "pad": "%s"}',
    # escapes in keys, odd keys
    b'{"to\\u006fls": [], "pad": "%s"}',
    b'{"a b": 1, "\\"": 2, "": 3, "\xc3\xa9": 4, "pad": "%s"}',
    # invalid JSON in a part, or around the parts
    b'{"messages": [{"role": "system", "content": "\\ud800"}], "pad": "%s"}',
    b'{"messages": [1,], "pad": "%s"}',
    b'{"messages": [1 2], "pad": "%s"}',
    b'{"tools": [1], "pad": "%s",}',
    b'{"tools": [1], "pad": "%s"} {}',
    b'{"tools": NaN, "pad": "%s"}',
    b'{"tools": [01], "pad": "%s"}',
    b'{"tools": "\t", "pad": "%s"}',
    # integers orjson cannot keep, in every kind of part
    b'{"tools": [123456789012345678901234567890], "pad": "%s"}',
    b'{"messages": [{"role": "user", "content": "a", "n": -99999999999999999999}], "pad": "%s"}',
    b'{"prompt_ids": [1, 2, 123456789012345678901234567890], "pad": "%s"}',
    b'{"prompt_ids": [1, 2.0, true, null, [3]], "pad": "%s"}',
    b'{"prompt_ids": [1, -1, 4294967296], "pad": "%s"}',
    b'{"prompt_ids": "1, 2", "pad": "%s"}',
    # not an object
    b'[{"pad": "%s"}]',
    b'{"messages": {"pad": "%s"}}',
])
def test_same_answer_for_odd_bodies(raw: bytes) -> None:
    same(raw.replace(b"%s", PAD.encode()))


def test_nesting_is_bounded_in_every_part() -> None:
    for depth in (json_io.MAX_DEPTH - 3, json_io.MAX_DEPTH - 2, json_io.MAX_DEPTH - 1,
                  json_io.MAX_DEPTH, json_io.MAX_DEPTH + 1):
        deep = "[" * depth + "]" * depth
        for raw in (f'{{"tools": {deep}, "pad": "{PAD}"}}',
                    f'{{"messages": [{{"role": "user", "x": {deep}}}], "pad": "{PAD}"}}',
                    f'{{"messages": [{deep}], "pad": "{PAD}"}}'):
            same(raw.encode())


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=20)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fields=st.dictionaries(st.sampled_from(["messages", "tools", "prompt_ids", "model", "x"]),
                              json_values, max_size=5),
       pad=st.booleans(), indent=st.sampled_from([None, 1]))
def test_same_answer_for_any_body(fields: dict[str, Any], pad: bool, indent: int | None) -> None:
    if pad:
        fields = {**fields, "pad": PAD}
    same(json.dumps(fields, indent=indent).encode())


def test_remembered_parts_come_with_their_key_material() -> None:
    memo = PartMemo()
    raw = json.dumps(body(prompt_ids=[1, 2, 3])).encode()
    data, first = parse_body(raw, memo, "t")
    data2, again = parse_body(raw, memo, "t")
    for parsed, known in ((data, first), (data2, again)):
        assert known.packed(parsed["tools"]) == keys.packed_part(TOOLS)
        assert known.packed(parsed["messages"][0]) == keys.packed_part(SYSTEM)
        assert known.packed(parsed["messages"][1]) is None  # small: not remembered
        assert parsed["prompt_ids"] == [1, 2, 3]  # a list, unless the caller shares parts
        static = parsed["messages"][:1]
        assert FastKeyPacker().request(None, known)[1].fields(static, parsed["tools"], {"k": 1}) == \
            keys.canonical_bytes(static, parsed["tools"], {"k": 1})
    assert data2["tools"] is not data["tools"]  # not shared unless asked


def shared_ids(raw: bytes, memo: PartMemo, scope: str = "t") -> Any:
    value = parse_body(raw, memo, scope, share=True)[0]["prompt_ids"]
    return ("ids", value.ids) if isinstance(value, TokenIds) else ("value", value)


def expected_ids(raw: bytes) -> Any:
    """What the ids are: token ids (the cache's own check), or another value it refuses."""
    value = json_io.loads(raw)["prompt_ids"]
    try:
        return "ids", checked_token_ids(value).ids
    except InvalidRequestError:
        return "value", value


@pytest.mark.parametrize("dump", [lambda v: json.dumps(v, separators=(",", ":")).encode(),
                                  lambda v: json.dumps(v).encode(),
                                  lambda v: json.dumps(v, indent=1).encode()])
def test_prompt_ids_from_the_last_ids_text(dump: Any) -> None:
    """A sharing caller gets the ids packed; a text that starts as the scope's last one is
    taken from it up to their last common comma, and only the rest parsed."""
    rng = random.Random(7)
    memo = PartMemo()
    ids = [rng.randrange(200_000) for _ in range(3000)]
    turns = [ids, ids + [5, 6], ids[:-1] + [ids[-1] + 1], ids[:1500] + [1] * 10, ids[:1500],
             ids[:1500] + [10, 2], ids[:1500] + [1], [3], [], [ids[0]] + [1], ids + ids, ids,
             ids[:10] + [1.5], ids[:10] + [2**32], ids[:10] + [2**70], ids[:10] + [[1]],
             ids[:10] + [True, None], ids[:10] + ["7"], ids]
    for turn in turns:
        raw = dump(body(prompt_ids=turn))
        assert shared_ids(raw, memo) == expected_ids(raw), turn[-3:]
    # odd texts after a good one: each gets the whole parse's answer
    good = json.dumps(body(prompt_ids=ids)).encode()
    for tail in (b"]", b",]", b", ]", b",1]", b"1]", b", 1e3]", b", -1]", b", 01]", b"]]",
                 b", 4294967296]", b", \"1\"]", b", {}]", b",,1]", b", 1 2]"):
        assert shared_ids(good, memo)[0] == "ids"
        at = good.index(b"]", good.index(b'"prompt_ids"'))
        odd = good[:at - 3] + tail + good[at + 1:]
        assert whole(odd)[0] == "error" or shared_ids(odd, memo) == expected_ids(odd), odd[-40:]
        if whole(odd)[0] == "error":
            assert parts(odd, memo, share=True) == whole(odd)


def test_prompt_ids_texts_are_per_scope_and_per_start() -> None:
    memo = PartMemo()
    ids = list(range(2000))
    parse_body(json.dumps(body(prompt_ids=ids)).encode(), memo, "a", share=True)
    raw = json.dumps(body(prompt_ids=ids[:1000] + [7])).encode()
    text = json.dumps(ids).encode()
    assert memo.get_ids("b", text) is None
    assert shared_ids(raw, memo, "b") == ("ids", ids[:1000] + [7])
    assert memo.get_ids("b", text).part != memo.get_ids("a", text).part
    # another agent of the same scope (another static part): its own text, the first kept
    other = [9] * 300 + ids
    assert shared_ids(json.dumps(body(prompt_ids=other)).encode(), memo, "a")[1] == other
    assert len(memo.remembered_ids()) == 3 and memo.get_ids("a", text).part == text


def test_the_ids_memo_is_bounded_in_bytes() -> None:
    memo = PartMemo(max_ids_bytes=200_000)
    for i in range(50):
        shared_ids(json.dumps(body(prompt_ids=[i] * 3000)).encode(), memo)
    assert memo.ids_nbytes <= 200_000 and len(memo.remembered_ids()) < 50


def test_known_parts_are_found_by_identity_only() -> None:
    known = KnownParts()
    tools = [dict(t) for t in TOOLS]
    known.add_packed(tools, b"\x90")
    assert known.packed(tools) == b"\x90"
    assert known.packed([dict(t) for t in TOOLS]) is None  # equal, but not the parsed object
    # a part whose packing is wrong for the object given would change the key: only the very
    # object parsed is ever looked up, never an equal one
    assert FastKeyPacker().request(None, known)[1].fields([], [dict(t) for t in TOOLS], None) == \
        keys.canonical_bytes([], TOOLS, None)


def test_shared_values_are_what_the_bytes_parse_to() -> None:
    memo = PartMemo()
    raw = orjson.dumps(body())
    first, _ = parse_body(raw, memo, "t", share=True)
    again, known = parse_body(raw, memo, "t", share=True)
    assert again["tools"] is first["tools"]
    assert again["messages"][0] is first["messages"][0]
    assert known.packed(again["tools"]) == keys.packed_part(TOOLS)
    assert again == json_io.loads(raw)
    # only a caller that asked to share gets the shared value
    assert parse_body(raw, memo, "t")[0]["tools"] is not first["tools"]


def test_scopes_do_not_share_anything() -> None:
    memo = PartMemo()
    raw = orjson.dumps(body())
    a, _ = parse_body(raw, memo, "tenant-a", share=True)
    b, known_b = parse_body(raw, memo, "tenant-b", share=True)
    assert b["tools"] is not a["tools"]
    assert len(memo) == 4  # tools and the system message, once per scope
    assert known_b.packed(b["tools"]) == keys.packed_part(TOOLS)


def test_a_different_byte_is_a_different_part() -> None:
    memo = PartMemo()
    parse_body(orjson.dumps(body()), memo, "t", share=True)
    changed = [dict(TOOLS[0], function={**TOOLS[0]["function"], "name": "other"}), *TOOLS[1:]]
    data, known = parse_body(orjson.dumps(body(tools=changed)), memo, "t", share=True)
    assert data["tools"] == changed
    assert known.packed(data["tools"]) == keys.packed_part(changed)


def test_unpackable_parts_are_not_remembered() -> None:
    memo = PartMemo()
    big = [{"n": 2**70, "pad": PAD}]  # exact through the standard library, but not msgpack's
    raw = json.dumps(body(tools=big)).encode()
    data, known = parse_body(raw, memo, "t", share=True)
    assert data["tools"] == big and known.packed(data["tools"]) is None
    assert parse_body(raw, memo, "t", share=True)[0]["tools"] is not data["tools"]


def test_the_memo_is_bounded_in_bytes() -> None:
    memo = PartMemo(max_bytes=64 * REMEMBERED_BYTES)
    for i in range(200):
        parse_body(orjson.dumps(body(tools=[{"i": i, "pad": PAD}])), memo, "t", share=True)
    assert memo.nbytes <= 64 * REMEMBERED_BYTES
    assert 0 < len(memo) < 60


def test_small_bodies_and_no_memo_parse_whole() -> None:
    """Nothing is remembered of a body under ``REMEMBERED_BYTES``, nor without a memo: no
    part comes with key material (the cache packs it the plain way)."""
    memo = PartMemo()
    small = orjson.dumps({"tools": [{"pad": "x" * (REMEMBERED_BYTES // 2)}]})
    assert len(small) < REMEMBERED_BYTES
    data, hints = parse_body(small, memo)
    assert data == json_io.loads(small) and not hints and len(memo) == 0
    data, hints = parse_body(orjson.dumps(body()))
    assert data == json_io.loads(orjson.dumps(body())) and not hints
    assert hints.packed(data["tools"]) is None


def test_the_same_bytes_deeper_in_a_body_are_checked_again() -> None:
    """A part remembered as a top-level value (one level more allowed) is not taken as a
    message unchecked: the same bytes there nest one level too deep."""
    memo = PartMemo()
    depth = json_io.MAX_DEPTH - 1  # as deep as a top-level value may be
    nested = "[" * (depth - 1) + "]" * (depth - 1)
    part = f'{{"pad": "{PAD}", "x": {nested}}}'
    top = f'{{"tools": {part}}}'.encode()
    deeper = f'{{"messages": [{part}]}}'.encode()
    assert parts(top, memo)[0] == "ok"
    assert parts(deeper, memo) == whole(deeper) and whole(deeper)[0] == "error"


BIG_MESSAGE = {"role": "tool", "content": "y" * REMEMBERED_BYTES}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layout=st.lists(st.sampled_from(["big", "system", "small", "odd"]), max_size=8),
       odd=json_values, indent=st.sampled_from([None, 0, 1]),
       separators=st.sampled_from([None, (",", ":"), (" , ", " : ")]))
def test_messages_mixing_large_and_small_ones(layout: list[str], odd: Any, indent: int | None,
                                              separators: tuple[str, str] | None) -> None:
    """A conversation's messages, the large ones parsed alone and the runs of small ones
    between them together: the same answer as the whole parse, however the array is laid out."""
    pick = {"big": BIG_MESSAGE, "system": SYSTEM, "small": {"role": "user", "content": "hi"},
            "odd": odd}
    messages = [pick[kind] for kind in layout]
    raw = json.dumps({"messages": messages, "pad": PAD}, indent=indent,
                     separators=separators).encode()
    same(raw)
    same(raw, share=True)


@pytest.mark.parametrize("text", [
    b'{"messages": [%s, 1, %s], "pad": "%s"}', b'{"messages": [%s,%s], "pad": "%s"}',
    b'{"messages": [ %s ,\n %s ], "pad": "%s"}', b'{"messages": [%s, , %s], "pad": "%s"}',
    b'{"messages": [%s, %s,], "pad": "%s"}', b'{"messages": [,%s, %s], "pad": "%s"}',
    b'{"messages": [%s %s], "pad": "%s"}', b'{"messages": [%s, [1, 2] %s], "pad": "%s"}',
])
def test_odd_arrays_of_large_messages(text: bytes) -> None:
    big = orjson.dumps(BIG_MESSAGE)
    same(text % (big, big, PAD.encode()))
