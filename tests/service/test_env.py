"""Every documented environment variable works: ``prefix-cache serve`` started with only
variables (a store, files, folders) serves what they name; ``--help``, the README and
``deploy/`` name the same variables, one per setting."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
from pathlib import Path

import pytest

from prefix_cache import cli
from prefix_cache.model_folders.demo import DEMO_TEMPLATE
from prefix_cache.service.settings import ServiceSettings, env_name
from prefix_cache.testing.offline_tokenizers import make_model_dir

from tests.support.loopback import local_client
from tests.support.paths import REPO
from tests.support.redis_server import RedisServer, needs_redis
from tests.support.serve_process import ServeProcess
from tests.support.sidecar import bearer

# Variables that are not settings of `serve`, each documented where it is read.
OTHER_VARIABLES = {
    "PREFIX_CACHE_HOME",            # where the demo model folder is made (serve --help)
    "PREFIX_CACHE_TOKENIZERS",      # the offline tokenizers' disk cache (serve --help)
    "PREFIX_CACHE_FAST_PATH",       # every accelerator on or off (serve --help)
    "PREFIX_CACHE_ENGINE_API_KEY",  # serve-engine --api-key
    "PREFIX_CACHE_TEMPLATES",       # tests: the conformance templates' folder
    "PREFIX_CACHE_ARTIFACTS",       # tests: where the browser tests leave screenshots
}
BOUNDARY = {"messages": [{"role": "system", "content": "You are a coding agent."},
                         {"role": "user", "content": "Fix the failing test."}]}


@pytest.fixture(autouse=True)
def _no_service_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("PREFIX_CACHE_"):
            monkeypatch.delenv(name)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("models") / "folder-model", "qwen3",
                          DEMO_TEMPLATE)


@needs_redis
def test_serve_takes_its_store_models_and_keys_from_the_environment(
        tmp_path: Path, model_dir: Path, redis: RedisServer) -> None:
    models = tmp_path / "models.yaml"
    models.write_text(json.dumps({"file-model": {"folder": str(model_dir)}}))
    keys = tmp_path / "keys.yaml"
    keys.write_text(json.dumps({"tenants": {"sk-env": "envco"}, "admin_keys": ["sk-env-admin"]}))
    env = {env_name("redis_url"): redis.url, env_name("models_file"): str(models),
           env_name("model_dirs"): str(model_dir), env_name("keys_file"): str(keys)}
    server = ServeProcess([], tmp_path / "home", env=env)
    try:
        url = server.base_url()
        with local_client(base_url=url) as http:
            assert http.get("/v1/models").status_code == 401          # the keys file's keys
            tenant, admin = (bearer(k) for k in ("sk-env", "sk-env-admin"))
            names = [m["id"] for m in http.get("/v1/models", headers=tenant).json()["data"]]
            assert names == ["file-model", "folder-model"]            # the file's, the folder
            result = http.post("/v1/prefix/boundary", headers=tenant,
                               json={**BOUNDARY, "model": "file-model"}).json()
            assert result["cache"] == "miss" and result["key"].startswith("spc:envco:file-model:")
            assert http.get("/readyz", headers=admin).json()["store"]["backend"] == "tiered"
            assert http.get("/admin/stats", headers=admin).json()["store"]["backend"] == "tiered"
        assert redis.cli("exists", result["key"]).strip() == "1"      # the entry is in Redis
    finally:
        assert server.stop() == 0, "".join(server.log)


def test_serve_makes_the_demo_model_where_the_environment_says(tmp_path: Path) -> None:
    home, tokenizers = tmp_path / "home", tmp_path / "tokenizers"
    server = ServeProcess([], home, env={"PREFIX_CACHE_TOKENIZERS": str(tokenizers)})
    try:
        url = server.base_url()
        with local_client(base_url=url) as http:
            assert http.post("/v1/prefix/boundary", json=BOUNDARY).json()["cache"] == "miss"
    finally:
        assert server.stop() == 0, "".join(server.log)
    assert (home / "demo-qwen3" / "chat_template.jinja").is_file()
    assert [p.name.split("-")[0] for p in tokenizers.iterdir() if p.is_dir()] == ["qwen3"]


def test_a_renamed_variable_stops_serve_with_the_name_to_use(
        monkeypatch: pytest.MonkeyPatch, model_dir: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("PREFIX_CACHE_REDIS", "redis://127.0.0.1:1/0")
    assert cli.main(["serve", "--model", str(model_dir)]) == 2
    assert "set PREFIX_CACHE_REDIS_URL instead" in capsys.readouterr().err


def _serve_help() -> str:
    """What ``prefix-cache serve --help`` prints."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exited:
        cli.main(["serve", "--help"])
    assert exited.value.code == 0
    return out.getvalue()


def test_help_readme_and_deploy_name_the_same_variables() -> None:
    help_text = _serve_help()
    settings = {env_name(name) for name in ServiceSettings.model_fields}
    assert {v for v in settings if v not in help_text} == set()       # one each, all in --help
    assert {"PREFIX_CACHE_HOME", "PREFIX_CACHE_TOKENIZERS",
            "PREFIX_CACHE_FAST_PATH"} <= set(re.findall(
        r"PREFIX_CACHE_[A-Z_]+", help_text))
    documents = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")),
                 *sorted(p for p in (REPO / "deploy").rglob("*") if p.is_file())]
    named = {v: doc.relative_to(REPO) for doc in documents
             for v in re.findall(r"PREFIX_CACHE_[A-Z0-9_]*[A-Z0-9]", doc.read_text())}
    unknown = {v: str(where) for v, where in named.items()
               if v not in settings | OTHER_VARIABLES}
    assert unknown == {}
    for line in (REPO / "deploy" / "prefix-cache.env").read_text().splitlines():
        if line and not line.startswith("#"):
            assert line.split("=", 1)[0] in settings, line
