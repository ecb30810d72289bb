"""Fixtures of the service tests: the recording upstream, the demo model, and a real
``mlx_lm.server`` serving the tiny random-weights model.

The root ``conftest.py`` loads this as a plugin, so each
session fixture exists once per run however many modules use it. Every wait is bounded.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol, TypeVar

import httpx
import pytest

from prefix_cache.service.upstream import Upstream

from .agent_upstream import AgentRecorder, agent_upstream
from .loopback import free_port, local_client
from .paths import openblas
from .recording_upstream import Recorder, recording_upstream
from .server_thread import ServerThread
from .sidecar import TENANT_KEYS, engine_sidecar_app, served, sidecar_app

MLX_STARTUP_TIMEOUT_S = 120.0
TINY_MODEL = "tiny-qwen3"   # the tiny model's folder name: the name the sidecar serves it by
# The engine sidecar's admin key (the dashboard's) and metrics key (Prometheus's).
ENGINE_ADMIN, ENGINE_METRICS = "sk-engine-admin", "sk-engine-metrics"


class _Resettable(Protocol):
    def reset(self) -> None: ...


R = TypeVar("R", bound=_Resettable)


def _on_uvicorn(rec: R, upstream: Callable[[R], Any]) -> Iterator[tuple[R, str]]:
    """A recording upstream app on a real uvicorn: its recorder and base URL."""
    with ServerThread(upstream(rec), log_level="critical") as url:
        yield rec, url


def _emptied(server: tuple[R, str]) -> R:
    server[0].reset()
    return server[0]


@pytest.fixture(scope="session")
def recorder_server() -> Iterator[tuple[Recorder, str]]:
    yield from _on_uvicorn(Recorder(), recording_upstream)


@pytest.fixture
def recorder(recorder_server: tuple[Recorder, str]) -> Recorder:
    return _emptied(recorder_server)


# The agent APIs' recording upstream: it serves Messages and Responses as well as chat.
@pytest.fixture(scope="module")
def rec_server() -> Iterator[tuple[AgentRecorder, str]]:
    yield from _on_uvicorn(AgentRecorder(), agent_upstream)


@pytest.fixture
def rec(rec_server: tuple[AgentRecorder, str]) -> AgentRecorder:
    return _emptied(rec_server)


@pytest.fixture(scope="module")
def agent_app(rec_server: tuple[AgentRecorder, str], demo_tokenizer: Any) -> Any:
    """A sidecar in front of ``rec_server``, a model for each kind of upstream: one serving the
    agent APIs itself (native), one serving chat only, each plain and ``specprefill``, and a
    model with no upstream (boundary-only)."""
    url = rec_server[1]
    return sidecar_app(
        served("native", demo_tokenizer, Upstream(url, apis=("messages", "responses"))),
        served("native-spec", demo_tokenizer, Upstream(url, "specprefill")),
        served("chat-only", demo_tokenizer, Upstream(url)),
        served("chat-only-spec", demo_tokenizer, Upstream(url, "specprefill", apis=())),
        served("boundary-only", demo_tokenizer),
        api_keys=TENANT_KEYS)


# -- the test module's sidecar ------------------------------------------------------------------


@pytest.fixture(scope="module")
def base(app: Any) -> Iterator[str]:
    """The test module's ``app`` on a real uvicorn: its base URL."""
    with ServerThread(app) as url:
        yield url


@pytest.fixture
def http(base: str) -> Iterator[httpx.Client]:
    """A loopback client of ``base``."""
    with local_client(base_url=base) as client:
        yield client


# -- models -------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def demo_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from prefix_cache.model_folders.demo import demo_model_dir

    return demo_model_dir(tmp_path_factory.mktemp("home"))


@pytest.fixture(scope="session")
def demo_tokenizer(demo_folder: Path) -> Any:
    from prefix_cache.model_folders.model_dir import load_tokenizer

    return load_tokenizer(demo_folder)


# -- a real mlx_lm.server -----------------------------------------------------------------------


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("mlx_lm")
    from engine_adapter.testing.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / TINY_MODEL)


@pytest.fixture(scope="module")
def engine_sidecar(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory,
                   ) -> Iterator[tuple[str, Any]]:
    """The sidecar on the in-process MLX engine serving the tiny model, its KV disk tier on (in
    a folder of its own), with tenant, admin and metrics keys: its base URL and its engine (an
    ``MLXBackend``). The app's shutdown closes the engine."""
    from engine_adapter.backend import MLXBackend

    kv_dir = tmp_path_factory.mktemp("engine-kv")
    app = engine_sidecar_app(tiny_model_dir, api_keys=TENANT_KEYS, admin_keys=[ENGINE_ADMIN],
                             metrics_keys=[ENGINE_METRICS],
                             engine_options={"kv_disk_dir": str(kv_dir)})
    engine = app.state.service.models.get(TINY_MODEL).engine
    assert isinstance(engine, MLXBackend)
    with ServerThread(app) as url:
        yield url, engine
    assert engine.closed  # the app's shutdown closed the engine


def _mlx_env() -> dict[str, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    blas = openblas()  # mlx's CPU backend is slow on the reference BLAS
    if blas:
        env["LD_PRELOAD"] = blas
    return env


@pytest.fixture(scope="session")
def mlx_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``python -m mlx_lm.server`` on the tiny model; its base URL once /health answers."""
    port = free_port()
    log_path = tmp_path_factory.mktemp("mlx") / "mlx_lm.server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mlx_lm.server", "--model", str(tiny_model_dir),
             "--host", "127.0.0.1", "--port", str(port), "--max-tokens", "16"],
            stdout=log, stderr=subprocess.STDOUT, env=_mlx_env(),
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + MLX_STARTUP_TIMEOUT_S
        with local_client(timeout=2.0) as client:
            while True:  # readiness poll, bounded
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("mlx_lm.server did not start:\n"
                                       + log_path.read_text(errors="replace")[-3000:])
                try:
                    if client.get(f"{url}/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
