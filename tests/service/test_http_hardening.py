"""The HTTP surface against what a hostile or broken peer sends: bodies nested to break an
encoder, bodies that never end, the wrong content type, upstreams that answer odd statuses,
and a Host header that would steer a redirect (issue #15, items 5, 6, 7, 9 and 10)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import pytest

from prefix_cache.util import json_io
from prefix_cache.service.upstream import Upstream

from tests.support.paths import REPO
from tests.support.raw_http import endless_chunked_post, raw_upstream
from tests.support.recording_upstream import Recorder
from tests.support.sidecar import bearer, served, sidecar_app, unique_system


BODY_LIMIT = 256 * 1024
ADMIN = "sk-hardening-admin"
LIMIT = 128  # json_io.MAX_DEPTH, the documented nesting limit (checked below)
ODD_STATUSES = (302, 307, 600, 999)
RELAYED_STATUSES = (201, 404, 503)


def raw_answer(status: int, extra: str = "") -> bytes:
    body = b'{"error": {"message": "from the raw upstream"}}'
    return (f"HTTP/1.1 {status} Whatever\r\nContent-Type: application/json\r\n{extra}"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body


@pytest.fixture(scope="module")
def app(recorder_server: tuple[Recorder, str], demo_tokenizer: Any) -> Iterator[Any]:
    """The sidecar, with upstreams that answer odd statuses alive as long as it is."""
    url = recorder_server[1]
    with ExitStack() as stack:
        odd = {status: stack.enter_context(raw_upstream(raw_answer(
            status, "Location: http://10.0.0.7/internal\r\n" if 300 <= status < 400 else "")))
            for status in (*ODD_STATUSES, *RELAYED_STATUSES)}
        yield sidecar_app(
            served("rec", demo_tokenizer, Upstream(url)),
            served("rec-spec", demo_tokenizer, Upstream(url, "specprefill")),
            *(served(f"status-{s}", demo_tokenizer, Upstream(u)) for s, u in odd.items()),
            max_body_bytes=BODY_LIMIT, admin_keys=[ADMIN])


def nested(depth: int) -> Any:
    """A value of ``depth`` levels: ``[[...[]...]]``."""
    value: Any = []
    for _ in range(depth - 1):
        value = [value]
    return value


def post_json(http: Any, path: str, body: bytes) -> Any:
    return http.post(path, content=body, headers={"content-type": "application/json"})


def body_nested_to(depth: int, model: str, where: str, big_int: bool = False) -> bytes:
    """A chat body whose total nesting is exactly ``depth`` (the body object is level 1)."""
    messages: list[dict[str, Any]] = [unique_system(), {"role": "user", "content": "Hi"}]
    body: dict[str, Any] = {"model": model, "messages": messages}
    if big_int:
        body["seed_of_record"] = 10**30  # the standard library re-parses such bodies
    if where == "metadata":
        body["metadata"] = nested(depth - 1)                     # level 2 ... depth
    elif where == "tools":                                       # body, tools, tool, function,
        body["tools"] = [{"type": "function", "function": {      # parameters: levels 1-5
            "name": "t", "parameters": {"x": nested(depth - 5)}}}]
    else:                                                        # body, messages, message
        messages[0]["extra"] = nested(depth - 3)
    return json.dumps(body).encode()


# -- 5: one nesting limit where bodies are parsed ------------------------------------------------


@pytest.mark.parametrize("depth", [LIMIT + 1, 300])
@pytest.mark.parametrize("where", ["metadata", "tools", "messages"])
@pytest.mark.parametrize("path, model", [("/v1/chat/completions", "rec-spec"),
                                         ("/v1/prefix/boundary", "rec")])
def test_a_body_nested_past_the_limit_is_a_400(http: Any, recorder: Recorder, depth: int,
                                                where: str, path: str, model: str) -> None:
    r = post_json(http, path, body_nested_to(depth, model, where, big_int=True))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "json_too_deep"
    assert f"more than {LIMIT} levels" in r.json()["error"]["message"]
    assert recorder.requests == []


def test_1024_levels_with_a_long_integer_is_a_400_not_a_500(http: Any) -> None:
    # orjson parses 1024 levels; the standard library's re-parse (for the long integer) and its
    # encoder recurse in Python and gave a RecursionError: a 500.
    raw = (b'{"model": "rec-spec", "seed": 1000000000000000000000000000000, "messages": '
           b'[{"role": "user", "content": "Hi"}], "metadata": ' + b"[" * 1022 + b"]" * 1022
           + b"}")
    for path in ("/v1/chat/completions", "/v1/prefix/boundary"):
        r = post_json(http, path, raw)
        assert r.status_code == 400 and r.json()["error"]["code"] == "json_too_deep", r.text


@pytest.mark.parametrize("where", ["metadata", "tools", "messages"])
def test_a_body_nested_to_the_limit_is_served(http: Any, recorder: Recorder, where: str) -> None:
    raw = body_nested_to(LIMIT, "rec-spec", where, big_int=True)
    r = post_json(http, "/v1/chat/completions", raw)
    assert r.status_code == 200, r.text
    forwarded = recorder.last.body
    assert forwarded["seed_of_record"] == 10**30        # still exact, re-encoded by the sidecar
    assert r.headers["x-prefix-cache"] == "miss"


def test_json_io_bounds_nesting_exactly_and_keeps_big_integers() -> None:
    limit = json_io.MAX_DEPTH
    assert limit == LIMIT
    assert json_io.loads(json.dumps(nested(limit))) == nested(limit)
    for text in (json.dumps(nested(limit + 1)), json.dumps({"n": 10**40, "x": nested(limit)})):
        with pytest.raises(json_io.JSONInputError) as info:
            json_io.loads(text)
        assert info.value.code == "json_too_deep"
    # Many containers side by side are not deep: only the path from the root counts.
    wide = {"tools": [{"a": [{"b": {}}]} for _ in range(limit * 4)], "n": 10**40}
    assert json_io.loads(json.dumps(wide)) == wide
    assert json_io.dumps(json_io.loads(json.dumps(nested(limit)))) == json.dumps(
        nested(limit)).replace(" ", "").encode()


def test_the_cli_reports_a_deep_line_and_goes_on(demo_folder: Any, tmp_path: Any) -> None:
    ok = {"messages": [{"role": "system", "content": "S."}, {"role": "user", "content": "U."}]}
    lines = [json.dumps(ok), '{"n": 100000000000000000000000, "x": ' + "[" * 1000 + "]" * 1000
             + "}", json.dumps(ok)]
    requests = tmp_path / "requests.jsonl"
    requests.write_text("\n".join(lines) + "\n")
    out = subprocess.run([sys.executable, "-m", "prefix_cache.cli", "boundary", "--model",
                          str(demo_folder), "--requests", str(requests)], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    results = [json.loads(line) for line in out.stdout.splitlines()]
    assert out.returncode == 2 and len(results) == 3, out.stderr[-2000:]
    assert "nested more than" in results[1]["error"]
    assert results[0]["cache"] == "miss" and results[2]["cache"] == "hit"


# -- 6: upstream statuses that are not relayed -----------------------------------------------------


@pytest.mark.parametrize("status", ODD_STATUSES)
def test_an_odd_upstream_status_is_a_502_with_a_message(http: Any, status: int) -> None:
    body = {"model": f"status-{status}", "messages": [{"role": "user", "content": "Hi"}]}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 502, r.text
    error = r.json()["error"]
    assert error["code"] == "upstream_bad_status" and f"status {status}" in error["message"]
    assert "location" not in r.headers and "10.0.0.7" not in r.text


@pytest.mark.parametrize("status", RELAYED_STATUSES)
def test_2xx_answers_and_4xx_5xx_errors_are_still_relayed(http: Any, status: int) -> None:
    body = {"model": f"status-{status}", "messages": [{"role": "user", "content": "Hi"}]}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == status
    if status >= 400:
        assert r.json()["error"]["message"] == "from the raw upstream"


# -- 7: a 413 closes the connection ------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/prefix/boundary", "/v1/chat/completions"])
def test_a_413_closes_the_connection_on_an_endless_body(base: str, path: str) -> None:
    answer, sent, closed = endless_chunked_post(base, path, max_bytes=128 << 20,
                                                max_seconds=20.0)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    # The server stopped reading and closed: what was sent is the limit plus what the socket
    # buffers hold, not everything the client was willing to send.
    assert closed and sent < 32 << 20, sent
    assert b"connection: close" in answer.lower()


def test_a_declared_length_over_the_limit_closes_too(base: str) -> None:
    import socket
    from urllib.parse import urlsplit

    parts = urlsplit(base)
    with socket.create_connection((parts.hostname, parts.port), timeout=10) as sock:
        sock.sendall(f"POST /v1/prefix/boundary HTTP/1.1\r\nHost: {parts.netloc}\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {BODY_LIMIT * 8}\r\n"
                     "\r\n".encode())
        answer = b""
        while chunk := sock.recv(65536):   # ends when the server closes (timeout: fails)
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 413") and b"connection: close" in answer.lower()


# -- 10: only application/json ------------------------------------------------------------------


@pytest.mark.parametrize("content_type", [None, "text/plain", "text/plain; charset=utf-8",
                                          "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", "application/jsonx"])
@pytest.mark.parametrize("path", ["/v1/prefix/boundary", "/v1/chat/completions", "/admin/purge"])
def test_a_body_that_is_not_declared_json_is_a_415(http: Any, recorder: Recorder, path: str,
                                                   content_type: str | None) -> None:
    body = {"model": "rec", "messages": [unique_system(), {"role": "user", "content": "Hi"}],
            "tenant": "default"}
    headers = bearer(ADMIN)
    if content_type is not None:
        headers["content-type"] = content_type
    r = http.post(path, content=json.dumps(body).encode(), headers=headers)
    assert r.status_code == 415, r.text
    assert r.json()["error"]["code"] == "unsupported_media_type"
    assert "application/json" in r.json()["error"]["message"]
    assert recorder.requests == []


def test_json_with_a_charset_is_accepted(http: Any) -> None:
    body = {"model": "rec", "messages": [unique_system(), {"role": "user", "content": "Hi"}]}
    r = http.post("/v1/prefix/boundary", content=json.dumps(body).encode(),
                  headers={"content-type": "Application/JSON; charset=utf-8"})
    assert r.status_code == 200 and r.json()["cache"] == "miss"


# -- 9: no redirect built from the Host header ----------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/models/", "/healthz/", "/admin/stats/"])
def test_a_trailing_slash_is_a_404_not_a_redirect_to_the_host_header(http: Any, path: str) -> None:
    r = http.get(path, headers={"host": "evil.example"})
    assert r.status_code == 404 and "location" not in r.headers
    assert "evil.example" not in r.text
