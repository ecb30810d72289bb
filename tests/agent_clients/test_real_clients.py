"""The three agent clients people run (Claude Code, Codex, opencode: real, pinned, from the npm
registry), non-interactively and configured as docs/agent-clients.md tells their users, each
in a network namespace that reaches nothing but the sidecar. In front of a scripted upstream
(``tool_loop_upstream``) and on the in-process engine (``serve --engine mlx`` on a tiny
random-weights Qwen3 with a 32k context, its replies scripted by ``tool_loop_engine``), every
client completes a tool loop of two calls and an answer at its defaults; its static prefix is
a miss on turn 1 and a hit from turn 2; the usage it reports is what the upstream or the
engine computed. One sidecar per target for the module."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import real_clients
from tests.support.real_clients import run_client
from tests.support.loopback import local_client
from tests.support.observed_app import Observed
from tests.support.server_thread import ServerThread
from tests.support.service_fixtures import TINY_MODEL
from tests.support.sidecar import engine_sidecar_app, served, sidecar_app
from tests.support.tool_loop_engine import ToolLoopEngine
from tests.support.tool_loop_upstream import ANSWER, LoopRecorder, tool_loop_upstream

pytestmark = pytest.mark.skipif(real_clients.missing() is not None,
                                reason=str(real_clients.missing()))

CLIENTS = ("claude", "codex", "opencode")
CONTEXT = 262_144
PROMPT = "Read alpha.txt, then beta.txt, then tell me what they hold."


@pytest.fixture(scope="module")
def relay(tiny_model_dir: Path) -> Iterator[tuple[str, Observed, LoopRecorder]]:
    """The sidecar relaying to the scripted upstream (an OpenAI-compatible one: every API
    goes to it as chat completions)."""
    from prefix_cache.model_folders.model_dir import load_tokenizer
    from prefix_cache.service.upstream import Upstream

    rec = LoopRecorder()
    with ServerThread(tool_loop_upstream(rec)) as upstream_url:
        app = Observed(sidecar_app(served(TINY_MODEL, load_tokenizer(tiny_model_dir),
                                          Upstream(upstream_url))))
        with ServerThread(app) as url:
            yield url, app, rec


@pytest.fixture(scope="module")
def long_tiny_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a context of a model agents are run on (256k): the clients' own
    output requests (Claude Code 32k-128k, opencode 32k) fit beside their ~6-14k prompts."""
    folder = tmp_path_factory.mktemp("long") / TINY_MODEL
    folder.mkdir()
    for item in tiny_model_dir.iterdir():
        (folder / item.name).symlink_to(item)
    config = json.loads((tiny_model_dir / "config.json").read_text())
    (folder / "config.json").unlink()
    (folder / "config.json").write_text(json.dumps({**config,
                                                    "max_position_embeddings": CONTEXT}))
    return folder


@pytest.fixture(scope="module")
def engine(long_tiny_dir: Path) -> Iterator[tuple[str, Observed, ToolLoopEngine]]:
    pytest.importorskip("mlx_lm")
    sidecar = engine_sidecar_app(long_tiny_dir, engine_options={"kv_disk_bytes": 0})
    backend = sidecar.state.service.models.get(TINY_MODEL).engine
    scripted = ToolLoopEngine(backend.engine, backend.tokenizer, LoopRecorder())
    backend.engine = scripted
    app = Observed(sidecar)
    with ServerThread(app) as url:
        yield url, app, scripted


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    work = tmp_path / "work"
    work.mkdir()
    (work / "alpha.txt").write_text("alpha holds the first half\n")
    (work / "beta.txt").write_text("beta holds the second half\n")
    return work


def run_loop(name: str, url: str, app: Observed, workdir: Path) -> Any:
    """The client's run, checked: it completed the loop; the sidecar answered each of its
    turns with the static prefix a miss, then hits."""
    app.seen.clear()
    before = dashboard(url)
    run = run_client(name, url, TINY_MODEL, PROMPT, workdir)
    refused = next((f"{s.path} {s.status}: {bytes(s.answer[:600])!r}" for s in app.seen
                    if s.status != 200), "none")
    detail = (f"{name} exited {run.returncode}; first refused request: {refused}; "
              f"stderr: {run.stderr[-1500:]}")
    if real_clients.netns():
        assert "netns: isolated" in run.stderr, detail
    assert run.returncode == 0, detail
    assert [s.status for s in app.seen] == [200] * len(app.seen), detail
    assert run.answer() == ANSWER, detail
    outputs = run.tools_run()
    assert len(outputs) == 2, (outputs, detail)
    assert "first half" in outputs[0] and "second half" in outputs[1], outputs
    loop = app.posts(tools=True)
    assert [s.cache for s in loop] == ["miss", "hit", "hit"], [(s.path, s.cache) for s in loop]
    reported = [s.usage() for s in loop]
    total = (sum(u[0] for u in reported), sum(u[1] for u in reported))
    assert run.usage() == total, (run.usage(), reported)
    # The dashboard's totals moved by what the session's requests were, and no more.
    after = dashboard(url)
    moved = {k: after[k] - before[k] for k in before}
    everything = [s.usage() for s in app.seen]
    assert moved == {"hit": sum(s.cache == "hit" for s in app.seen),
                     "miss": sum(s.cache == "miss" for s in app.seen),
                     "prompt_tokens": sum(u[0] for u in everything),
                     "cached_tokens": sum(u[1] for u in everything)}, moved
    return reported


def dashboard(url: str) -> dict[str, int]:
    """What the dashboard's tables total now: boundaries by result, prompt tokens."""
    with local_client() as http:
        stats = http.get(f"{url}/dashboard/stats.json").json()["metrics"]
    usage = stats["usage"]
    return {"hit": stats["hits"], "miss": stats["misses"],
            "prompt_tokens": sum(u["prompt_tokens"] for u in usage),
            "cached_tokens": sum(u["cached_tokens"] for u in usage)}


@pytest.mark.parametrize("name", CLIENTS)
def test_client_tool_loop_through_the_relay(name: str, relay, workdir: Path) -> None:
    url, app, rec = relay
    rec.reset()
    reported = run_loop(name, url, app, workdir)
    # What the upstream computed: every prompt token (it keeps no cache), as it reported.
    upstream = [len(r.raw) // 4 for _, r in rec.requests if r.body.get("tools")]
    assert reported == [(n, 0) for n in upstream]


@pytest.mark.parametrize("name", CLIENTS)
def test_client_tool_loop_on_the_engine(name: str, engine, workdir: Path) -> None:
    url, app, scripted = engine
    scripted.prefills.clear()
    reported = run_loop(name, url, app, workdir)
    loop = [p for p in scripted.prefills if p.tools]
    assert reported == [(p.prompt_tokens, p.reused_tokens) for p in loop]
    first, *later = loop
    assert first.reused_tokens < first.static_tokens   # turn 1: the static prefix computed
    for p in later:                                     # then reused, and the turns before
        assert p.reused_tokens >= p.static_tokens > 0
