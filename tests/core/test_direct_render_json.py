"""A direct render of messages a body parser made (``json_messages``) skips transformers' two
rebuilding walks over them and gives exactly the text of the full walk."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from prefix_cache.fastpath import PartMemo, _direct_render, parse_body

TEMPLATE = (
    "{% for m in messages %}{{ m | tojson }}|{{ m.role }}|{{ m.content }}|"
    "{{ m.reasoning_content }}|{{ m.thinking }}|{{ m.get('tool_calls') }}|"
    "{{ 'name' in m }}\n{% endfor %}"
)
scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False),
                    st.text(max_size=6))
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=5), inner, max_size=3)),
    max_leaves=10)
messages = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "tool", "system"])},
    optional={"content": st.one_of(st.none(), st.text(max_size=8), values),
              "reasoning": st.one_of(st.none(), st.text(max_size=5)),
              "thinking": st.one_of(st.none(), st.text(max_size=5)),
              "reasoning_content": st.one_of(st.none(), st.text(max_size=5)),
              "tool_calls": st.one_of(st.none(), values), "name": values}),
    min_size=1, max_size=5)


@settings(max_examples=300, deadline=None)
@given(messages)
def test_json_messages_render_as_the_full_walk(qwen3: Any, chat: list[dict[str, Any]]) -> None:
    template = _direct_render.compiled(qwen3, TEMPLATE)
    assert template is not None
    full = _direct_render.render(template, qwen3, chat, None, {}, json_messages=False)
    assert _direct_render.render(template, qwen3, chat, None, {}, json_messages=True) == full


def test_only_a_shared_bodys_messages_are_known_as_json() -> None:
    raw = b'{"messages": [{"role": "user", "content": "hi"}], "pad": "' + b"x" * 2048 + b'"}'
    for share in (False, True):
        data, known = parse_body(raw, PartMemo(), "t", share=share)
        assert known.all_json(data["messages"]) is share
        assert not known.all_json([{"role": "user", "content": "hi"}])  # another object
    data, known = parse_body(b'{"messages": [{"role": "user"}]}', PartMemo(), "t", share=True)
    assert known.all_json(data["messages"])  # small bodies too (parsed whole)
