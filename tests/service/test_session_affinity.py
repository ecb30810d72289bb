"""Session affinity from the agent clients' own ids (``session_hint.py``): the recorded requests
of Claude Code (``metadata.user_id``), Codex (``prompt_cache_key``) and opencode
(``x-session-affinity``) through the real sidecar to a pool of three upstream replicas. Sessions
that share one static prefix each keep every turn on one replica, and spread over the
replicas; without the ids they all share the static prefix's replica. Measured at load:
bench/session_affinity.py (docs/routing.md, "Sessions")."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from prefix_cache.cache.keys import model_label
from prefix_cache.service.pool import UpstreamPool
from prefix_cache.service.served_models import ServedModel
from prefix_cache.service.session_hint import MAX_HINT_CHARS, session_hint
from prefix_cache.service.upstream import Upstream
from tests.support.loopback import local_client
from tests.support.server_thread import ServerThread
from tests.support.sidecar import sidecar_app
from tests.support.tool_loop_upstream import LoopRecorder, tool_loop_upstream

FIXTURES = Path(__file__).resolve().parents[1] / "agent_clients" / "fixtures"
MODEL = "pooled"
PATHS = {"claude_code": "/v1/messages?beta=true", "codex": "/v1/responses",
         "opencode": "/v1/chat/completions"}
SESSIONS = 12


def recorded(client: str) -> list[dict[str, Any]]:
    lines = (FIXTURES / f"{client}.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def as_session(client: str, request: dict[str, Any], session: str | None,
               ) -> tuple[dict[str, Any], dict[str, str]]:
    """The recorded request with the session id replaced (None: every id taken out)."""
    body = {**request["body"], "model": MODEL}
    headers = {"content-type": "application/json"}
    if client == "claude_code":
        user = json.loads(body["metadata"]["user_id"])
        if session is None:
            body.pop("metadata")
        else:
            body["metadata"] = {"user_id": json.dumps({**user, "session_id": session})}
    elif client == "codex":
        body.pop("prompt_cache_key")
        if session is not None:
            body["prompt_cache_key"] = session
    elif session is not None:
        headers["x-session-affinity"] = session
    return body, headers


def test_each_client_names_its_session_where_the_hint_reads_it() -> None:
    claude, codex, opencode = (recorded(c)[0] for c in ("claude_code", "codex", "opencode"))
    assert session_hint(claude["body"], {}) == json.loads(
        claude["body"]["metadata"]["user_id"])["session_id"]
    assert session_hint(codex["body"], {}) == codex["body"]["prompt_cache_key"]
    assert session_hint(opencode["body"], opencode["headers"]) == \
        opencode["headers"]["x-session-affinity"]


@pytest.mark.parametrize("body, headers", [
    ({"metadata": {"user_id": "plain-user"}}, {}),
    ({"metadata": {"user_id": "{not json"}}, {}),
    ({"metadata": {"user_id": json.dumps({"session_id": 7})}}, {}),
    ({"metadata": "x"}, {}),
    ({"prompt_cache_key": ""}, {}),
    ({"prompt_cache_key": "k" * (MAX_HINT_CHARS + 1)}, {}),
    ([], {"x-session-affinity": ""}),
])
def test_what_is_no_hint(body: Any, headers: dict[str, str]) -> None:
    assert session_hint(body, headers) is None


@pytest.fixture(scope="module")
def pool(demo_tokenizer: Any) -> Iterator[tuple[str, list[LoopRecorder]]]:
    recorders = [LoopRecorder() for _ in range(3)]
    with contextlib.ExitStack() as stack:
        upstreams = [Upstream(stack.enter_context(ServerThread(tool_loop_upstream(r))))
                     for r in recorders]
        model = ServedModel(MODEL, model_label(MODEL), demo_tokenizer, upstreams[0],
                            pool=UpstreamPool(upstreams))
        yield stack.enter_context(ServerThread(sidecar_app(model))), recorders


def replicas_of(client: str, url: str, recorders: list[LoopRecorder], hinted: bool
                ) -> list[set[int]]:
    """For each session, the replicas its recorded turns were served on (its tool loop's:
    opencode's title request is a static prefix of its own)."""
    turns = [t for t in recorded(client) if t["body"].get("tools")]
    served: list[set[int]] = []
    with local_client(base_url=url, timeout=60.0) as http:
        for s in range(SESSIONS):
            for r in recorders:
                r.reset()
            for request in turns:
                body, headers = as_session(client, request, f"sess-{s}" if hinted else None)
                answer = http.post(PATHS[client], content=json.dumps(body), headers=headers)
                assert answer.status_code == 200, answer.text[:500]
            served.append({i for i, r in enumerate(recorders) for _ in r.requests})
    return served


@pytest.mark.parametrize("client", ["claude_code", "codex", "opencode"])
def test_sessions_sharing_a_static_prefix_stay_each_on_one_replica(client: str, pool) -> None:
    url, recorders = pool
    hinted = replicas_of(client, url, recorders, hinted=True)
    assert all(len(replicas) == 1 for replicas in hinted), hinted   # every turn of a session
    assert len(set().union(*hinted)) >= 2                          # sessions spread
    plain = replicas_of(client, url, recorders, hinted=False)
    assert len(set().union(*plain)) == 1                           # the static prefix's replica
