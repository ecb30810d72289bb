"""Request-level render fields on the sidecar (issue 23, item 2): each is rendered and keyed
exactly -- the boundary is the reference's over the render the engine does with that field --
or refused with a 400 naming it. Real uvicorn, real tokenizer, a recording upstream."""

from __future__ import annotations

from typing import Any

import pytest

from prefix_cache.model_folders.demo import DEMO_TEMPLATE
from prefix_cache.service.upstream import Upstream

from tests.support import reference
from tests.support.sidecar import served, sidecar_app, unique_system
from tests.support.tools import make_tools


# A request-level template that renders the system text in its own frame and no assistant turn:
# the default template's scaffold runs into the user's text under it.
PLAIN_TEMPLATE = (
    "{%- for m in messages %}{{- '### ' + m.role + ':\\n' + m.content + '\\n\\n' }}{%- endfor %}"
)
DOCS_TEMPLATE = (
    "{%- if documents %}{{- '<|im_start|>system\\nDocuments:' }}{%- for d in documents %}"
    "{{- '\\n- ' + d.title }}{%- endfor %}{{- '<|im_end|>\\n' }}{%- endif %}" + DEMO_TEMPLATE
)


@pytest.fixture(scope="module")
def app(recorder_server: tuple[Any, str], demo_tokenizer: Any) -> Any:
    return sidecar_app(served("rec", demo_tokenizer, Upstream(recorder_server[1])),
                       served("boundary-only", demo_tokenizer), ready_timeout_s=1.0)


def body(user: str = "Deploy the service.", tools: int = 2, **extra: Any) -> dict[str, Any]:
    messages = [unique_system(), {"role": "user", "content": user}]
    return {"model": "boundary-only", "messages": messages, "tools": make_tools(tools), **extra}


def boundary_twice(http: Any, request: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for _ in range(2):
        r = http.post("/v1/prefix/boundary", json={**request, "return_prompt_ids": True})
        assert r.status_code == 200, r.text
        out.append(r.json())
    assert [o["cache"] for o in out] == ["miss", "hit"]
    return out


def test_request_level_chat_template_is_rendered_and_keyed(http: Any, demo_tokenizer: Any) -> None:
    request = body(tools=0, chat_template=PLAIN_TEMPLATE)
    request.pop("tools")
    default = http.post("/v1/prefix/boundary", json={**request, "chat_template": None}).json()
    first, second = boundary_twice(http, request)
    expected = reference.exact(demo_tokenizer, request["messages"], None, None, PLAIN_TEMPLATE)
    prompt = reference.render(demo_tokenizer, request["messages"], None, None, PLAIN_TEMPLATE)
    assert first["specprefill_system_end"] == second["specprefill_system_end"] == expected > 0
    assert second["prompt_ids"] == list(prompt)
    assert first["key"] != default["key"]


@pytest.mark.parametrize("options", [
    {"add_generation_prompt": False},
    {"add_generation_prompt": False, "continue_final_message": True},
    {"continue_final_message": True},
])
def test_generation_flags_render_the_prompt_as_asked(http: Any, demo_tokenizer: Any,
                                                     options: dict[str, bool]) -> None:
    request = body(**options)
    request["messages"].append({"role": "assistant", "content": "Deploying now: step"})
    first, second = boundary_twice(http, request)
    flags = {"add_generation_prompt": False, **options}
    expected = reference.exact(demo_tokenizer, request["messages"], request["tools"], None, None,
                               flags)
    prompt = reference.render(demo_tokenizer, request["messages"], request["tools"], None, None,
                              options=flags)
    assert first["specprefill_system_end"] == second["specprefill_system_end"] == expected > 0
    assert second["prompt_ids"] == list(prompt)


def test_documents_are_template_variables_in_the_key(http: Any, demo_tokenizer: Any) -> None:
    docs = [{"title": "Runbook"}, {"title": "On-call"}]
    request = body(chat_template=DOCS_TEMPLATE, documents=docs)
    first, _ = boundary_twice(http, request)
    without = http.post("/v1/prefix/boundary", json={**request, "documents": None}).json()
    assert without["key"] != first["key"]
    kwargs = {"documents": docs}
    assert first["specprefill_system_end"] == reference.exact(
        demo_tokenizer, request["messages"], request["tools"], kwargs, DOCS_TEMPLATE)
    # chat_template_kwargs set the same name: theirs win, as in vLLM.
    own = http.post("/v1/prefix/boundary", json={
        **request, "chat_template_kwargs": {"documents": docs[:1]}}).json()
    assert own["specprefill_system_end"] == reference.exact(
        demo_tokenizer, request["messages"], request["tools"], {"documents": docs[:1]},
        DOCS_TEMPLATE)


@pytest.mark.parametrize("extra,field", [
    ({"add_special_tokens": True}, "add_special_tokens"),
    ({"truncate_prompt_tokens": 100}, "truncate_prompt_tokens"),
    ({"add_generation_prompt": True, "continue_final_message": True}, "continue_final_message"),
    ({"chat_template": 7}, "chat_template"),
    ({"chat_template": ""}, "chat_template"),
    ({"add_generation_prompt": "no"}, "add_generation_prompt"),
    ({"documents": "text"}, "documents"),
])
@pytest.mark.parametrize("path", ["/v1/prefix/boundary", "/v1/chat/completions"])
def test_unrenderable_fields_are_refused_by_name(http: Any, extra: dict[str, Any], field: str,
                                                 path: str) -> None:
    r = http.post(path, json={**body(), "model": "rec", **extra})
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]["message"]


def test_chat_completion_header_follows_the_request_template(http: Any, demo_tokenizer: Any,
                                                             recorder: Any) -> None:
    request = {**body(tools=0, chat_template=PLAIN_TEMPLATE), "model": "rec"}
    request.pop("tools")
    r = http.post("/v1/chat/completions", json=request)
    assert r.status_code == 200, r.text
    expected = reference.exact(demo_tokenizer, request["messages"], None, None, PLAIN_TEMPLATE)
    assert r.headers["x-specprefill-system-end"] == str(expected)
    assert recorder.last.body["chat_template"] == PLAIN_TEMPLATE  # forwarded as sent
