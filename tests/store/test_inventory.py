"""Inventories by tenant and model, and `prefix-cache stats` against a real Redis."""

from __future__ import annotations

import json

import pytest

from prefix_cache import StaticPrefixCache, cli
from prefix_cache.store.inventory import inventory, summarize
from prefix_cache.store import MemoryStore

from tests.support.redis_server import RedisServer, needs_redis
from tests.support.templates import BEHAVIOURS


def test_summarize_groups_by_namespace_and_model() -> None:
    got = summarize([("spc:a:m1:1", 10), ("spc:a:m1:2", 5), ("spc:a:m2:1", 1), ("spc:b:m1:1", 7),
                     ("garbage", 99)])
    assert got["entries"] == 4 and got["bytes"] == 23
    assert got["namespaces"]["a"] == {"entries": 3, "bytes": 16, "models": {
        "m1": {"entries": 2, "bytes": 15}, "m2": {"entries": 1, "bytes": 1}}}
    assert got["namespaces"]["b"]["models"] == {"m1": {"entries": 1, "bytes": 7}}


def test_inventory_of_a_real_cache(qwen3) -> None:
    store = MemoryStore()
    cache = StaticPrefixCache(store)
    for ns in ("t1", "t2"):
        for i in range(3):
            cache.resolve(qwen3, [{"role": "system", "content": f"s{i}"}, {"role": "user", "content": "u"}],
                          chat_template=BEHAVIOURS["default_system"], namespace=ns, model="m")
    assert inventory(store, "spc")["entries"] == 6
    assert inventory(store, "spc", namespace="t1")["namespaces"].keys() == {"t1"}


@needs_redis
def test_stats_command(tmp_path, capsysbinary) -> None:
    from prefix_cache.model_folders.demo import demo_model_dir

    server = RedisServer(tmp_path / "redis").start()
    try:
        model = demo_model_dir(tmp_path / "models")
        req = tmp_path / "r.jsonl"
        req.write_text("".join(json.dumps({"messages": [{"role": "system", "content": f"S{i}"},
                                                        {"role": "user", "content": "x"}]}) + "\n"
                               for i in range(4)))
        for ns in ("acme", "globex"):
            assert cli.main(["boundary", "--model", str(model), "--requests", str(req),
                             "--namespace", ns, "--redis", server.url]) == 0
        capsysbinary.readouterr()
        assert cli.main(["stats", "--redis", server.url]) == 0
        out = json.loads(capsysbinary.readouterr().out)
        assert out["entries"] == 8 and set(out["namespaces"]) == {"acme", "globex"}
        assert out["namespaces"]["acme"]["models"]["demo-qwen3"]["entries"] == 4
        assert cli.main(["stats", "--redis", server.url, "--namespace", "globex"]) == 0
        assert json.loads(capsysbinary.readouterr().out)["entries"] == 4
    finally:
        server.stop()


def test_stats_needs_a_store(capsysbinary, monkeypatch) -> None:
    monkeypatch.delenv("PREFIX_CACHE_REDIS_URL", raising=False)
    assert cli.main(["stats"]) == 2
    assert b"--redis" in capsysbinary.readouterr().err


@pytest.mark.parametrize("url", ["redis://127.0.0.1:1/0"])
def test_stats_with_dead_redis_is_a_clear_error(url, capsysbinary) -> None:
    assert cli.main(["stats", "--redis", url, "--timeout", "0.2"]) == 2
    assert b"redis" in capsysbinary.readouterr().err
