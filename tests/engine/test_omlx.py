"""The plug-in inside real oMLX: ``install(engine, boundary)`` on oMLX's own BatchedEngine,
scheduler and SpecPrefill, run in oMLX's own venv (it pins mlx-lm 0.31; this one has 0.32).

The venvs: ``PREFIX_CACHE_OMLX_PYTHONS`` (python paths, ``:``-separated), else those ``.ci/run``
makes (``.venv-omlx``: flyto-mlx 0.7.0; ``.venv-fusion``: fusion-mlx 0.10.24, where it
installs). Each runs ``engine_adapter.testing.omlx_check`` once (a tiny random-weights qwen3
target and draft, the real Qwen3 tokenizer, the Qwen3.5 template from ../shared or the
tools-first test template) and the tests read its report. No oMLX venv: skipped, saying why.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from engine_adapter.omlx_hooks import OmlxShapeError
from engine_adapter.omlx_tenant import key_tenant, tenant_of
from engine_adapter.plugin import SpecPrefillBoundary, install
from prefix_cache import StaticPrefixCache

from tests.support.paths import REPO, SHARED_TEMPLATES
from tests.support.templates import TOOLS_FIRST

VENVS = (REPO / ".venv-omlx" / "bin" / "python", REPO / ".venv-fusion" / "bin" / "python")
TOOL_CASES = ("tools_0", "tools_1", "tools_4", "tools_16", "tools_64")
EXACT_CASES = (*TOOL_CASES, "multi_turn", "no_thinking", "long_system", "sparse", "hit")


def _pythons() -> list[str]:
    given = os.environ.get("PREFIX_CACHE_OMLX_PYTHONS")
    paths = given.split(":") if given else [str(p) for p in VENVS if p.is_file()]
    return [p for p in paths if p]


def _has_omlx(python: str) -> bool:
    probe = subprocess.run([python, "-m", "engine_adapter.testing.omlx_check", "--probe"],
                           capture_output=True, timeout=300, check=False, cwd=REPO,
                           env={**os.environ, "PYTHONPATH": str(REPO)})
    return probe.returncode == 0


def _venv_name(python: str | None) -> str:
    return Path(python).parent.parent.name if python else "none"


@pytest.fixture(scope="module", params=_pythons() or [None], ids=_venv_name)
def report(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> dict[str, Any]:
    python = request.param
    if python is None:
        pytest.skip("no oMLX venv: .ci/run makes .venv-omlx (flyto-mlx 0.7.0); or set "
                    "PREFIX_CACHE_OMLX_PYTHONS to a python that imports omlx")
    if not _has_omlx(python):
        pytest.skip(f"{python} cannot import omlx (its install failed)")
    folder = tmp_path_factory.mktemp("omlx")
    template = SHARED_TEMPLATES / "Qwen3.5-4B.jinja"
    if not template.is_file():
        template = folder / "tools_first.jinja"
        template.write_text(TOOLS_FIRST, encoding="utf-8")
    out = folder / "report.json"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([python, "-m", "engine_adapter.testing.omlx_check", str(out),
                           "--models", str(folder), "--template", str(template)],
                          capture_output=True, text=True, timeout=900, env=env, cwd=REPO,
                          check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(out.read_text(encoding="utf-8"))  # type: ignore[no-any-return]


def test_install_finds_the_inline_shape(report: dict[str, Any]) -> None:
    assert report["shape"] == "text", report["version"]


@pytest.mark.parametrize("case", EXACT_CASES)
def test_scheduler_gets_the_exact_boundary_in_omlx_ids(report: dict[str, Any], case: str) -> None:
    row = report["cases"][case]
    assert row["truth"] > 0
    assert row["system_end"] == row["truth"]
    # The scheduler got ids (it encodes nothing), and they are oMLX's own encode of its render.
    assert row["ids_given"] and row["ids_equal_own"]


def test_non_streaming_chat_gets_omlx_ids(report: dict[str, Any]) -> None:
    row = report["cases"]["chat"]
    assert row["ids_given"] and row["ids_equal_own"] and (row["hit"], row["miss"]) == (1, 0)


def test_tools_grow_the_boundary(report: dict[str, Any]) -> None:
    ends = [report["cases"][c]["system_end"] for c in TOOL_CASES]
    assert ends == sorted(ends) and len(set(ends)) == len(ends)


def test_specprefill_keeps_the_whole_static_prefix_dense(report: dict[str, Any]) -> None:
    row = report["cases"]["sparse"]
    dense = set(row["dense"])
    assert set(range(row["truth"])) <= dense
    assert len(dense) < row["prompt_tokens"]  # it did drop tokens: after the static part


def test_second_request_is_a_hit_with_no_probe_render(report: dict[str, Any]) -> None:
    row = report["cases"]["hit"]
    assert (row["hit"], row["miss"], row["probe_renders"]) == (1, 0, 0)
    # A short hit stays on the loop; a miss rendered in the cache's threads, off oMLX's loop.
    assert row["thread_calls"] == 0
    assert report["cases"]["tools_64"]["miss"] == 1
    assert report["cases"]["tools_64"]["thread_calls"] > 0


@pytest.mark.parametrize("case", ["off_request", "off_model"])
def test_specprefill_off_costs_nothing(report: dict[str, Any], case: str) -> None:
    row = report["cases"][case]
    assert row["system_end"] == 0 and not row["ids_given"]  # oMLX's own path, untouched
    assert (row["hit"], row["miss"], row["probe_renders"], row["thread_calls"]) == (0, 0, 0, 0)
    assert report["cache_calls"] == report["cache_calls_on"]


def test_unknown_engine_is_refused_with_the_version() -> None:
    class NotOmlx:
        def stream_chat(self) -> None: ...

    with pytest.raises(OmlxShapeError) as raised:
        install(NotOmlx(), SpecPrefillBoundary(StaticPrefixCache()))
    text = str(raised.value)
    assert "NotOmlx" in text and "_inject_specprefill_system_end" in text
    assert "stream_generate" in text and "_apply_chat_template" in text



def test_each_api_key_is_a_tenant_with_its_own_entries(report: dict[str, Any]) -> None:
    rows = report["tenants"]
    assert [r["who"] for r in rows] == ["A", "A", "B", "A"]
    # The static prefix was stored under "default" before: each key's first request misses.
    assert [(r["hit"], r["miss"]) for r in rows] == [(0, 1), (1, 0), (0, 1), (1, 0)]
    assert all(r["system_end"] == r["truth"] > 0 for r in rows)


def test_tenant_of_a_request() -> None:
    assert tenant_of({"authorization": "Bearer sk-1"}) == key_tenant("sk-1")
    assert tenant_of({"x-api-key": "sk-1"}) == key_tenant("sk-1")
    assert tenant_of({"authorization": "bearer sk-2"}) != key_tenant("sk-1")
    assert "sk-1" not in key_tenant("sk-1")
    assert tenant_of({}) == "default"
    assert tenant_of({"x-tenant": "team-7", "authorization": "Bearer sk-1"},
                     header="X-Tenant") == "team-7"
    assert tenant_of({"authorization": "Bearer sk-1"}, header="x-tenant") == "default"
