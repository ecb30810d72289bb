"""Fixtures every test folder may use: the support plugins (the sidecar's recording upstream and
models, the engine's tiny models, the demo chat model), real tokenizers built offline once per
machine (disk cache), and a redis-server of a test's own."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Helper modules whose asserts test modules call: rewrite them for pytest's assert messages.
pytest.register_assert_rewrite("tests.support")

from tests.support.paths import use_openblas  # noqa: E402 (after the rewrite hook)

# The in-process engine tests' matmuls on OpenBLAS, not mlx's bundled reference BLAS (before any
# test module imports mlx; see tests/support/paths.py).
use_openblas()

# Session fixtures live in these plugins, so each exists once per run however many folders use
# it. None of them imports mlx at load: the tests that need it skip themselves without it.
pytest_plugins = [
    "tests.support.service_fixtures",
    "tests.support.engine_fixtures",
    "tests.support.demo_model_fixtures",
]


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[Any]:
    """A redis-server of this test's own, for tests that kill, pause or fill it."""
    from tests.support.redis_server import RedisServer

    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def qwen3() -> Any:
    from prefix_cache.testing.offline_tokenizers import load_offline_tokenizer

    return load_offline_tokenizer("qwen3")


@pytest.fixture(scope="session")
def llama3() -> Any:
    from prefix_cache.testing.offline_tokenizers import load_offline_tokenizer

    return load_offline_tokenizer("llama3.1")
