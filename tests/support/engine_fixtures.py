"""Fixtures and helpers of the engine tests: tiny random-weights models (float32, real Qwen3
vocabulary) built once per session, a request runner, logit comparisons, and the KV disk
tier's stores on a test's folder.

The root ``conftest.py`` loads this as a plugin and import
the helpers by name. Nothing here imports mlx at module level: the modules that use it skip
themselves when mlx is missing, and the plugin must still load then.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# Logprobs of one float32 forward against another that runs the same tokens in other chunks
# (restored KV, sparse prefill at keep 100%) differ by rounding only.
ATOL = 1e-4


@pytest.fixture(scope="session")
def engine_models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.getbasetemp() / "engine-models"


def load_tiny(root: Path, arch: str, *, draft: bool = False) -> Any:
    """A tiny target (hidden 64, 2 layers) or draft (hidden 32, 1 layer, GQA 2:1: about 1/20
    of the target's transformer compute) of ``arch``, built on first use under ``root``."""
    from mlx_lm.utils import load_model

    from engine_adapter.testing.tiny_model import tiny_model_folder

    if draft:
        folder = tiny_model_folder(root / f"{arch}-32x1h2k1", arch, hidden=32, layers=1,
                                   heads=2, kv_heads=1)
    else:
        folder = tiny_model_folder(root / f"{arch}-64x2", arch)
    return load_model(folder)[0]


@pytest.fixture(scope="module")
def target(engine_models_dir: Path, qwen3: Any) -> tuple[Any, Any]:
    """The Qwen3 tiny target and its tokenizer."""
    return load_tiny(engine_models_dir, "qwen3"), qwen3


@pytest.fixture(scope="module")
def draft(engine_models_dir: Path) -> Any:
    return load_tiny(engine_models_dir, "qwen3", draft=True)


@pytest.fixture
def engines(target: tuple[Any, Any]) -> Any:
    """``make(model=None, **options)``: an MLXEngine on ``model`` (the target by default);
    every engine still open at teardown is closed."""
    from engine_adapter.mlx_engine import MLXEngine

    made: list[MLXEngine] = []

    def make(model: Any = None, **options: Any) -> MLXEngine:
        engine = MLXEngine(model if model is not None else target[0], **options)
        made.append(engine)
        return engine

    yield make
    for engine in made:
        if not engine.closed:  # a test may close some itself (a restart)
            engine.close()


def turn(tok: Any, static_words: int, user: str) -> tuple[list[int], int]:
    """Prompt ids with a static part of about ``static_words`` words and its length."""
    static = tok.encode("<|im_start|>system\nYou are a careful assistant with tools. "
                        + " ".join(f"tool_{i}(path, limit)" for i in range(static_words))
                        + "<|im_end|>\n")
    rest = tok.encode(f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n")
    return static + rest, len(static)


def next_turn(tok: Any, previous: list[int], reply: str, user: str) -> list[int]:
    """``previous`` (ending in the assistant header) + the reply + a new user turn + header."""
    return previous + tok.encode(f"{reply}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n"
                                 "<|im_start|>assistant\n")


def run(engine: Any, ids: list[int], end: int, **fields: Any) -> list[Any]:
    """Every event of one request (3 tokens unless told), logprobs included."""
    from engine_adapter.mlx_engine import GenerationRequest

    fields.setdefault("max_tokens", 3)
    return list(engine.generate(GenerationRequest(ids, specprefill_system_end=end,
                                                  return_logprobs=True, **fields)))


def restored_from(previous: list[int], events: list[Any], ids: list[int]) -> int:
    """What ``ids`` restores from a finished request (prompt ``previous``, its ``events``): the
    prompt and the generated tokens it shares, up to all but its own last token."""
    from prefix_cache.cache.boundary import common_prefix_len

    return min(common_prefix_len(previous + [e.token for e in events], ids), len(ids) - 1)


def assert_close(a: Any, b: Any) -> None:
    import mlx.core as mx

    diff = mx.abs(a - b).max().item()
    assert diff < ATOL, f"max |logprob difference| {diff}"


def assert_matches_dense(model: Any, ids: list[int], events: list[Any]) -> None:
    """Every step's distribution equals a dense forward over the prompt plus the tokens so far:
    the KV is right and decode positions continue at the full prompt length."""
    from engine_adapter.testing.reference import dense_logprobs

    tokens = [e.token for e in events]
    for k, event in enumerate(events):
        assert_close(event.logprobs, dense_logprobs(model, ids + tokens[:k]))


# -- the KV disk tier: stores on a test's folder (a new one stands for a restarted process) --

GIB = 1 << 30
KV_SUFFIX = ".safetensors"


@pytest.fixture
def fingerprints(target: tuple[Any, Any]) -> dict[str, str]:
    from engine_adapter.mlx_engine.kv import file as kv_file

    return {"target": kv_file.model_fingerprint(target[0])}


@pytest.fixture
def disks(tmp_path: Path, fingerprints: dict[str, str]) -> Iterator[Any]:
    """``open(max_bytes=1 GiB, root=tmp_path / "kv", **kw)``: a DiskKVStore (a new one each
    call stands for a restarted process); every store made is closed at teardown."""
    from engine_adapter.mlx_engine.kv.disk import DiskKVStore

    made: list[Any] = []

    def open_disk(max_bytes: int = GIB, root: Path | None = None, **kw: Any) -> Any:
        kw.setdefault("fingerprints", fingerprints)
        disk = DiskKVStore(root or tmp_path / "kv", max_bytes, **kw)
        made.append(disk)
        return disk

    yield open_disk
    for disk in made:
        disk.close()


def files(root: Path) -> list[Path]:
    """The KV files below ``root`` (temporary ones left out)."""
    return sorted(p for p in root.rglob(f"*{KV_SUFFIX}") if not p.name.startswith("."))


def restart(engines: Any, disks: Any, old: Any, **options: Any) -> Any:
    """Close ``old`` (its writes finish) and start a new engine on a new store of the folder."""
    old.close()
    old.kv_disk.close()
    return engines(kv_disk=disks(), **options)


def snapshot_of(model: Any, ids: list[int]) -> Any:
    """A dense KV snapshot of ``ids`` on ``model``."""
    import mlx.core as mx

    from engine_adapter.mlx_engine.kv import cache as kv_cache

    cache = kv_cache.make_cache(model)
    model(mx.array([ids]), cache=cache)
    return kv_cache.snapshot(cache, len(ids))
