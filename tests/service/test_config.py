"""``prefix-cache serve``: settings from flags and environment, the models file, refusals, and
the real command on loopback (curl flow, several workers)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from prefix_cache import cli
from prefix_cache.model_folders.demo import DEMO_TEMPLATE
from prefix_cache.service.flags import flag_overrides
from prefix_cache.service.limits import TenantLimitOverride
from prefix_cache.service.served_models import load_model_specs
from prefix_cache.service.server import make_settings, note_store_at_start, startup_warnings
from prefix_cache.service.settings import ServiceSettings
from prefix_cache.service.tenants import KeyRing, KeysConfig
from prefix_cache.service.upstream import Upstream, normalize_base_url
from prefix_cache.testing.offline_tokenizers import make_model_dir

from tests.support.loopback import free_port, local_client
from tests.support.paths import REPO
from tests.support.serve_process import ServeProcess


@pytest.fixture(autouse=True)
def _no_service_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("PREFIX_CACHE_") and name.lower()[13:] in ServiceSettings.model_fields:
            monkeypatch.delenv(name)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("models") / "my-model", "qwen3", DEMO_TEMPLATE)


# -- settings -----------------------------------------------------------------------------------


def test_flags_win_over_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PREFIX_CACHE_PORT", "9001")
    monkeypatch.setenv("PREFIX_CACHE_HOST", "127.0.0.2")
    monkeypatch.setenv("PREFIX_CACHE_MODEL_DIRS", os.pathsep.join(["/m/a", "/m/b"]))
    monkeypatch.setenv("PREFIX_CACHE_MAX_BODY_BYTES", "1234")
    monkeypatch.setenv("PREFIX_CACHE_REDIS", "")
    args = cli.build_parser().parse_args(["serve", "--port", "9002", "--workers", "3"])
    settings = make_settings(flag_overrides(vars(args)))
    assert (settings.host, settings.port, settings.workers) == ("127.0.0.2", 9002, 3)
    assert settings.model_dirs == [Path("/m/a"), Path("/m/b")]
    assert settings.max_body_bytes == 1234 and settings.redis_url is None
    assert settings.uses_memory_store
    monkeypatch.setenv("PREFIX_CACHE_MODEL_DIRS", json.dumps(["/x"]))
    assert ServiceSettings().model_dirs == [Path("/x")]


@pytest.mark.parametrize("overrides, fragment", [
    ({"port": 70000}, "port"), ({"workers": 0}, "workers"), ({"upstream_kind": "vllm"}, "upstream_kind"),
    ({"max_body_bytes": 0}, "max_body_bytes"),
])
def test_invalid_settings_name_the_value(overrides: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        make_settings(overrides)


def test_several_workers_on_memory_warn_that_hits_are_per_worker() -> None:
    assert startup_warnings(ServiceSettings()) == []
    [warning] = startup_warnings(ServiceSettings(workers=4))
    assert "per worker" in warning and "--redis" in warning
    assert startup_warnings(ServiceSettings(workers=4, redis_url="redis://127.0.0.1:6379/0")) == []


def test_upstream_urls() -> None:
    assert normalize_base_url("http://127.0.0.1:8080") == "http://127.0.0.1:8080/v1"
    assert normalize_base_url("http://h:1/v1/") == "http://h:1/v1"
    assert Upstream("http://h:1/openai/v1").chat_url == "http://h:1/openai/v1/chat/completions"
    assert Upstream("http://h:1/v1").health_url == "http://h:1/health"
    for bad in ("h:1", "ftp://h/v1", "http:///v1"):
        with pytest.raises(ValueError, match="upstream URL"):
            normalize_base_url(bad)


# -- models ---------------------------------------------------------------------------------------


def test_model_dirs_are_named_after_their_folder(model_dir: Path) -> None:
    specs = load_model_specs(ServiceSettings(model_dirs=[model_dir], upstream="http://h:1"))
    assert [(s.name, s.folder, s.upstream, s.upstream_kind) for s in specs] == [
        ("my-model", model_dir, "http://h:1", "openai")]


def test_no_model_serves_the_demo_folder(tmp_path: Path) -> None:
    folder = tmp_path / "demo-qwen3"
    specs = load_model_specs(ServiceSettings(), demo_dir=lambda: folder)
    assert [(s.name, s.folder) for s in specs] == [("demo-qwen3", folder)]


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_models_file(model_dir: Path, tmp_path: Path, suffix: str) -> None:
    (tmp_path / "t.jinja").write_text(DEMO_TEMPLATE)
    entries = {
        "qwen/served-name": {"folder": str(model_dir), "template": "t.jinja",
                             "upstream": "http://a:1/v1", "upstream_kind": "specprefill"},
        "local": {"folder": os.path.relpath(model_dir, tmp_path)},
    }
    path = tmp_path / f"models{suffix}"
    path.write_text(json.dumps(entries) if suffix == ".json" else _yaml(entries))
    specs = load_model_specs(ServiceSettings(models_file=path, upstream="http://fallback:2",
                                             upstream_model="default_model"))
    first, second = specs
    assert (first.name, first.template, first.upstream, first.upstream_kind) == (
        "qwen/served-name", tmp_path / "t.jinja", "http://a:1/v1", "specprefill")
    assert second.folder.resolve() == model_dir.resolve()
    assert (second.upstream, second.upstream_model) == ("http://fallback:2", "default_model")


def _yaml(entries: dict[str, Any]) -> str:
    import yaml

    return yaml.safe_dump(entries, sort_keys=False)


@pytest.mark.parametrize("text, fragment", [
    ("m: [1]\n", "must be a mapping"),
    ("m: {folder: x, colour: red}\n", "colour"),
    ("- a\n", "mapping at the top level"),
    ("m: {folder: x, upstream: 'nohost'}\n", "upstream URL"),
    ("a/m: {folder: x}\nb/m: {folder: y}\n", "same key label"),
    ("m: {folder: x, engine: vllm}\n", "unknown engine"),
    ("m: {folder: x\n", "not valid"),
])
def test_bad_models_files_are_refused(tmp_path: Path, text: str, fragment: str) -> None:
    path = tmp_path / "models.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=fragment):
        load_model_specs(ServiceSettings(models_file=path))


def test_engine_specs_are_accepted_and_checked(model_dir: Path, tmp_path: Path) -> None:
    (spec,) = load_model_specs(ServiceSettings(model_dirs=[model_dir], engine="mlx",
                                               draft_model=model_dir))
    assert (spec.engine, spec.draft_model, spec.upstream) == ("mlx", model_dir, None)
    with pytest.raises(ValueError, match="give --engine mlx"):
        load_model_specs(ServiceSettings(model_dirs=[model_dir], draft_model=model_dir))
    with pytest.raises(ValueError, match="both an in-process engine and an upstream"):
        load_model_specs(ServiceSettings(model_dirs=[model_dir], engine="mlx",
                                         upstream="http://a:1/v1"))
    with pytest.raises(ValueError, match="needs --workers 1"):
        load_model_specs(ServiceSettings(model_dirs=[model_dir], engine="mlx", workers=2))
    # An entry naming an engine takes no default upstream, and one naming an upstream no engine.
    path = tmp_path / "models.yaml"
    path.write_text(f"e: {{folder: {model_dir}, engine: mlx, draft_model: d}}\n"
                    f"u: {{folder: {model_dir}, upstream: 'http://b:2'}}\n")
    e, u = load_model_specs(ServiceSettings(models_file=path, upstream="http://a:1/v1"))
    assert (e.engine, e.upstream, e.draft_model) == ("mlx", None, tmp_path / "d")
    assert (u.engine, u.upstream) == (None, "http://b:2")
    e, u = load_model_specs(ServiceSettings(models_file=path, engine="mlx"))
    assert (u.engine, u.draft_model) == (None, None)


def test_engine_options_from_flags_environment_and_models_file(
        model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    flags = flag_overrides({"engine_option": ["kv_bytes=8GiB", "max_context = 4096"]})
    settings = ServiceSettings(**flags)
    assert settings.engine_options == {"kv_bytes": "8GiB", "max_context": "4096"}
    monkeypatch.setenv("PREFIX_CACHE_ENGINE_OPTIONS", '{"conversation_bytes": "2GiB"}')
    assert ServiceSettings().engine_options == {"conversation_bytes": "2GiB"}
    # Given flags replace the environment's options, as every flag wins over its variable.
    assert ServiceSettings(**flags).engine_options == {"kv_bytes": "8GiB", "max_context": "4096"}
    monkeypatch.delenv("PREFIX_CACHE_ENGINE_OPTIONS")
    with pytest.raises(ValueError, match="KEY=VALUE"):
        make_settings({"engine_options": ["kv_bytes"]})
    # A models-file entry lays its options over the settings', key by key.
    path = tmp_path / "models.yaml"
    path.write_text(f"e: {{folder: {model_dir}, engine: mlx, engine_options: {{kv_bytes: 1MiB}}}}\n"
                    f"f: {{folder: {model_dir}, engine: mlx}}\n")
    e, f = load_model_specs(ServiceSettings(models_file=path, engine_options={
        "kv_bytes": "8GiB", "max_context": 4096}))
    assert e.engine_options == {"kv_bytes": "1MiB", "max_context": 4096}
    assert f.engine_options == {"kv_bytes": "8GiB", "max_context": 4096}


@pytest.mark.parametrize("entry, settings, fragment", [
    ("engine: mlx, engine_options: {kv_bytez: 1GiB}", {}, "kv_bytez: Extra inputs"),
    ("engine: mlx", {"engine_options": {"specprefill_keep_pct": 0}}, "specprefill_keep_pct"),
    ("engine: mlx", {"engine_options": {"kv_bytes": "lots"}}, "kv_bytes"),
    ("engine_options: {kv_bytes: 1GiB}", {}, "give engine: mlx too"),
])
def test_bad_engine_options_are_refused_naming_the_model_and_key(
        model_dir: Path, tmp_path: Path, entry: str, settings: dict[str, Any],
        fragment: str) -> None:
    path = tmp_path / "models.yaml"
    path.write_text(f"m: {{folder: {model_dir}, {entry}}}\n")
    with pytest.raises(ValueError, match=fragment) as info:
        load_model_specs(ServiceSettings(models_file=path, **settings))
    assert "'m'" in str(info.value)


def test_engine_options_parse_sizes_and_list_the_known_keys() -> None:
    from engine_adapter.options import EngineOptions

    options = EngineOptions.parse({"kv_bytes": "8GiB", "conversation_bytes": "512MiB",
                                   "max_context": "32768", "specprefill_keep_pct": "0.1"})
    assert (options.kv_bytes, options.conversation_bytes) == (8 << 30, 512 << 20)
    assert (options.max_context, options.specprefill_keep_pct) == (32768, 0.1)
    assert EngineOptions.parse(None) == EngineOptions()
    with pytest.raises(ValueError, match="known: kv_bytes, conversation_bytes"):
        EngineOptions.parse({"nope": 1})
    with pytest.raises(ValueError, match="max_context"):
        EngineOptions.parse({"max_context": 1})


# -- the command ----------------------------------------------------------------------------------


@pytest.mark.parametrize("argv, fragment", [
    (["--engine", "mlx"], "the MLX engine"),  # the folder has tokenizer files, no weights
    (["--draft-model", "/some/draft"], "give --engine mlx"),
    (["--engine", "mlx", "--upstream", "http://a:1"], "both an in-process engine and an upstream"),
    (["--model", "/no/such/folder"], "does not exist"),
    (["--upstream", "localhost:8080"], "must be http"),
    (["--port", "-1"], "port"),
    (["--engine", "mlx", "--engine-option", "kv_bytes"], "KEY=VALUE"),
    (["--engine", "mlx", "--engine-option", "kv_bytes=huge"], "kv_bytes"),
])
def test_serve_exits_2_on_what_it_cannot_serve(model_dir: Path, capsys: pytest.CaptureFixture[str],
                                                argv: list[str], fragment: str) -> None:
    extra = [] if "--model" in argv else ["--model", str(model_dir)]
    assert cli.main(["serve", *extra, *argv]) == 2
    assert fragment in capsys.readouterr().err


@pytest.mark.parametrize("command", ["serve", "serve-engine"])
def test_a_port_in_use_is_found_before_any_model_loads(
        command: str, capsys: pytest.CaptureFixture[str]) -> None:
    """The port is checked first: a folder that does not exist (what loading would find) is
    not reached, and the one line names the address."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code = cli.main([command, "--model", "/no/such/folder", "--port", str(port)])
    err = capsys.readouterr().err
    assert code == 2 and f"cannot listen on 127.0.0.1:{port}" in err, err
    assert "does not exist" not in err and "Traceback" not in err


def test_the_shared_store_is_pinged_at_start(redis: Any) -> None:
    """A Redis that does not answer is logged at start, not at the first request; one that
    answers says nothing. (The service's logger itself: a server run in this process before
    may have stopped it propagating to pytest's handler.)"""
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("prefix_cache.service")
    logger.addHandler(handler)
    try:
        assert note_store_at_start(ServiceSettings(redis_url=redis.url)) is True
        assert not records
        down = f"redis://127.0.0.1:{free_port()}/0"
        assert note_store_at_start(ServiceSettings(redis_url=down,
                                                   redis_connect_timeout_s=0.5)) is False
    finally:
        logger.removeHandler(handler)
    (record,) = records
    assert record.levelname == "WARNING"
    assert f"{down} does not answer at start" in record.getMessage()


@pytest.fixture
def serve_process(tmp_path: Path) -> Iterator[Any]:
    started: list[ServeProcess] = []

    def start(*args: str) -> ServeProcess:
        started.append(ServeProcess(list(args), tmp_path / "home"))
        return started[-1]

    yield start
    for process in started:
        process.stop()


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    """POST with curl as the README does, or httpx where curl is missing."""
    data = json.dumps(body)
    if shutil.which("curl"):
        out = subprocess.run(
            ["curl", "-sS", "--noproxy", "*", "--max-time", "30", f"{url}/v1/prefix/boundary",
             "-H", "content-type: application/json", "-d", data],
            capture_output=True, text=True, timeout=60, check=True).stdout
        return dict(json.loads(out))
    with local_client() as client:
        return dict(client.post(f"{url}/v1/prefix/boundary", content=data,
                                headers={"content-type": "application/json"}).json())


AGENT_BODY = {"messages": [{"role": "system", "content": "You are a coding agent."},
                           {"role": "user", "content": "Fix the failing test."}],
              "tools": [{"type": "function", "function": {
                  "name": "read_file", "description": "Read a file.",
                  "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}]}


def test_serve_the_demo_model_and_curl_twice(serve_process: Any) -> None:
    server = serve_process()
    url = server.base_url()
    body = json.loads((REPO / "examples" / "request.json").read_text())    # the README's tour
    first, second = _post(url, body), _post(url, body)
    assert (first["cache"], second["cache"]) == ("miss", "hit")
    assert first["specprefill_system_end"] == second["specprefill_system_end"] > 0
    assert first["key"] == second["key"] and first["key"].startswith("spc:default:demo-qwen3:")
    with local_client() as client:
        assert [m["id"] for m in client.get(f"{url}/v1/models").json()["data"]] == ["demo-qwen3"]
        chat = client.post(f"{url}/v1/chat/completions", json=body)
        assert chat.status_code == 400 and chat.json()["error"]["code"] == "model_not_servable"
    assert server.stop() == 0


def test_serve_logs_a_redis_down_at_start(serve_process: Any, model_dir: Path) -> None:
    server = serve_process("--model", str(model_dir), "--redis",
                           f"redis://127.0.0.1:{free_port()}/0")
    server.wait_for(r"WARNING.*the shared store redis://127\.0\.0\.1:\d+/0 does not answer at "
                    r"start")
    server.wait_for("Uvicorn running on")   # and serves meanwhile
    assert server.stop() == 0


def test_serve_with_several_workers_warns_and_serves(serve_process: Any, model_dir: Path) -> None:
    server = serve_process("--workers", "2", "--model", str(model_dir))
    server.wait_for(r"WARNING.*--workers 2 with the in-process memory store.*--redis")
    url = server.base_url()
    result = _post(url, AGENT_BODY)
    assert result["cache"] in ("miss", "hit") and result["key"].startswith("spc:default:my-model:")
    assert server.stop() == 0


def test_deploy_examples_are_valid() -> None:
    deploy = REPO / "deploy"
    specs = load_model_specs(ServiceSettings(models_file=deploy / "models.example.yaml"))
    assert [(s.name, s.upstream_kind, s.upstream is not None) for s in specs] == [
        ("qwen3-8b", "openai", True), ("qwen3-8b-vllm", "openai", True),
        ("qwen3-8b-specprefill", "specprefill", True),
        ("boundaries-only", "openai", False), ("qwen3-8b-in-process", "openai", False)]
    assert specs[-1].engine == "mlx" and specs[-1].engine_options["kv_bytes"] == "8GiB"
    assert [s.upstream_apis for s in specs[:3]] == [None, ["messages", "responses"], None]
    ring = KeyRing.from_settings(ServiceSettings(keys_file=deploy / "keys.example.yaml"))
    assert ring.tenants == ["acme", "globex"]
    ring.require_admin("Bearer sk-admin-CHANGE-ME")
    # Every per-tenant limit is shown in the example, the rates included.
    limits = KeysConfig.load(ServiceSettings(keys_file=deploy / "keys.example.yaml")).tenant_limits
    shown = {key for override in limits.values() for key in override.model_dump(exclude_unset=True)}
    assert shown == set(TenantLimitOverride.model_fields), shown
    assert limits["globex"].requests_per_minute == 60
