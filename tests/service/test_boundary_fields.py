"""The boundary route's quick check of a body answers exactly as ``BoundaryRequest`` does."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from prefix_cache.api.schemas import BoundaryRequest, _plain_boundary, boundary_fields

json_scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False),
                         st.text(max_size=5))
json_values = st.recursive(json_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=4), inner, max_size=3)),
    max_leaves=8)
dicts = st.dictionaries(st.text(max_size=4), json_values, max_size=3)
field_values = {
    "model": st.one_of(st.text(max_size=5), json_values),
    "messages": st.one_of(st.lists(dicts, max_size=3), st.lists(json_values, max_size=3),
                          json_values),
    "tools": st.one_of(st.none(), st.lists(dicts, max_size=3), st.lists(json_values, max_size=2),
                       json_values),
    "chat_template_kwargs": st.one_of(st.none(), dicts, json_values),
    "stream": st.one_of(st.none(), st.booleans(), json_values),
    "return_prompt_ids": st.one_of(st.booleans(), json_values),
    "other": json_values,
}
bodies = st.fixed_dictionaries({}, optional=field_values)


def _pydantic(data: dict[str, Any]) -> tuple[str | None, bool] | str:
    try:
        req = BoundaryRequest.model_validate(data)
    except ValidationError as exc:
        return str(exc)
    return req.model, req.return_prompt_ids


@settings(max_examples=600, deadline=None)
@given(bodies)
def test_the_quick_check_answers_as_pydantic(data: dict[str, Any]) -> None:
    expected = _pydantic(data)
    if _plain_boundary(data):  # never accepts what pydantic refuses
        assert not isinstance(expected, str)
    try:
        got: tuple[str | None, bool] | str = boundary_fields(data)
    except ValidationError as exc:
        got = str(exc)
    assert got == expected
    if not isinstance(got, str):
        assert type(got[1]) is bool


@pytest.mark.parametrize("data", [
    {"messages": [{"role": "user", "content": "hi"}]},
    {"messages": [{"role": "user"}], "tools": [{"type": "function"}] * 64, "model": "m",
     "chat_template_kwargs": {"x": 1}, "stream": False, "return_prompt_ids": True},
    {"messages": [{}], "tools": None, "chat_template_kwargs": None, "stream": None,
     "model": None},
])
def test_plain_bodies_take_the_quick_check(data: dict[str, Any]) -> None:
    assert _plain_boundary(data)
    assert boundary_fields(data) == _pydantic(data)


@pytest.mark.parametrize("data", [
    {}, {"messages": []}, {"messages": [[]]}, {"messages": [{}], "tools": {}},
    {"messages": [{}], "tools": [1]}, {"messages": [{}], "model": 5},
    {"messages": [{}], "stream": 1}, {"messages": [{}], "return_prompt_ids": 1},
    {"messages": [{}], "return_prompt_ids": None}, {"messages": [{}], "chat_template_kwargs": []},
])
def test_anything_else_goes_to_pydantic(data: dict[str, Any]) -> None:
    assert not _plain_boundary(data)
    with pytest.raises(ValidationError):
        boundary_fields(data)
