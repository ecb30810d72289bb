"""Shared fixtures: real tokenizers built offline once per machine (disk cache), tool sets."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

SHARED_TEMPLATES = Path(__file__).resolve().parents[1].parent / "shared" / "chat_templates"
# The real chat templates the template suites run over (../shared, or PREFIX_CACHE_TEMPLATES);
# none there, and those suites skip themselves.
TEMPLATES_DIR = Path(os.environ.get("PREFIX_CACHE_TEMPLATES", SHARED_TEMPLATES))
TEMPLATE_STEMS = (sorted(p.stem for p in TEMPLATES_DIR.glob("*.jinja"))
                  if TEMPLATES_DIR.is_dir() else [])

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Helper modules whose asserts test modules call: rewrite them for pytest's assert messages.
pytest.register_assert_rewrite("tests.support.engine_fixtures")


class Clock:
    """A monotonic clock the test moves by hand (circuit breakers, TTLs)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[Any]:
    """A redis-server of this test's own, for tests that kill, pause or fill it."""
    from tests.support.redis_server import RedisServer

    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.stop()


def make_tools(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """n distinct OpenAI function tools of realistic size."""
    return [
        {
            "type": "function",
            "function": {
                "name": f"tool_{seed}_{i}",
                "description": f"Tool number {i}: reads, edits or searches files in the workspace.",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "path": {"type": "string", "description": "Path relative to the root."},
                        "limit": {"type": "integer", "description": "Maximum results.", "default": 20},
                        "recursive": {"type": "boolean"},
                    },
                    "required": ["path"],
                },
            },
        }
        for i in range(n)
    ]


@pytest.fixture(scope="session")
def qwen3() -> Any:
    from prefix_cache.testing.offline_tokenizers import load_offline_tokenizer

    return load_offline_tokenizer("qwen3")


@pytest.fixture(scope="session")
def llama3() -> Any:
    from prefix_cache.testing.offline_tokenizers import load_offline_tokenizer

    return load_offline_tokenizer("llama3.1")
