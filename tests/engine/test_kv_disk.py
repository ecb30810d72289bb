"""The engine's KV disk tier: after a restart (a new engine and a new disk store on the same
folder) the static prefix and the conversation come back from disk and the answer equals an
uncached dense forward; bad files (corrupt, truncated, another model's, an old format) are
deleted and recomputed; a full write queue never blocks; two processes share the folder; purges
remove files; the folder stays within its bytes under churn; ``cached_tokens`` counts what came
from disk."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

from engine_adapter.backend import MLXBackend  # noqa: E402
from engine_adapter.mlx_engine import MLXEngine  # noqa: E402
from engine_adapter.mlx_engine.kv import file as kv_file  # noqa: E402
from engine_adapter.mlx_engine.kv.disk_setup import kv_disk_folder  # noqa: E402
from engine_adapter.mlx_engine.kv.fingerprint import folder_fingerprint  # noqa: E402
from engine_adapter.options import EngineOptions  # noqa: E402
from prefix_cache.engine.protocol import BackendRequest, SamplingParams  # noqa: E402
from tests.support.engine_fixtures import (  # noqa: E402  # noqa: E402
    assert_matches_dense,
    files,
    load_tiny,
    next_turn,
    restart,
    restored_from,
    run,
    turn,
)
from tests.support.paths import REPO  # noqa: E402

GIB = 1 << 30


def test_after_a_restart_the_kv_comes_from_disk_and_matches_dense(engines, disks, target,
                                                                 tmp_path):
    model, tok = target
    first, end = turn(tok, 40, "What is in the workspace?")
    engine = engines(kv_disk=disks())
    done = run(engine, first, end)
    assert done[0].prefill.reused_tokens == 0
    engine = restart(engines, disks, engine)
    # Another user turn on the same static prefix: restored from disk (the static entry, or
    # the conversation entry's longer shared part), and the answer is a dense forward's.
    other, _ = turn(tok, 40, "Something else entirely.")
    events = run(engine, other, end, max_tokens=4)
    assert events[0].prefill.reused_tokens >= end
    assert_matches_dense(model, other, events)
    disk = engine.snapshot_stats().kv_disk
    assert disk.hits == 1 and disk.loads == 1 and disk.discarded == 0
    engine = restart(engines, disks, engine)
    # The next turn of the first conversation: all of turn 1 (and what it shares of turn 1's
    # reply) comes back from disk.
    second = next_turn(tok, first, "A README.", "Open it.")
    events = run(engine, second, end, max_tokens=4)
    assert events[0].prefill.conversation_tokens == restored_from(first, done, second)
    assert_matches_dense(model, second, events)
    for path in files(tmp_path / "kv"):
        assert path.stat().st_mode & 0o777 == 0o600


def test_a_sparse_snapshot_keeps_its_positions_on_disk(disks, target):
    from engine_adapter.mlx_engine.kv import cache as kv_cache

    model, tok = target
    ids, _ = turn(tok, 10, "Hi.")
    cache = kv_cache.make_cache(model)
    model(mx.array([ids]), cache=cache)
    positions = tuple(range(0, 2 * (len(ids) // 2), 2))   # every other token, as if sparse
    stored = len(positions)
    snap = kv_cache.snapshot(cache, stored, positions=positions, span=positions[-1] + 1, keep_pct=0.2)
    disk = disks()
    assert disk.submit("conversation", "ns", "target", ids[:snap.span], snap)
    assert disk.flush()
    back = disks().longest_common_prefix("conversation", "ns", "target", ids, len(ids))
    assert back is not None
    n, loaded, entry_ids = back
    assert n == snap.span and entry_ids == ids[:snap.span]
    assert loaded.positions == positions and loaded.span == snap.span
    assert loaded.keep_pct == 0.2   # what the request kept, so a lookup can tell whether it fits
    assert loaded.dense_tokens == snap.dense_tokens == 1
    for (k, v), (k2, v2) in zip(snap.layers, loaded.layers, strict=True):
        assert mx.array_equal(k, k2) and mx.array_equal(v, v2)


def test_a_full_write_queue_drops_and_never_blocks(disks, target, monkeypatch):
    from engine_adapter.mlx_engine.kv import cache as kv_cache

    model, tok = target
    ids, _ = turn(tok, 5, "Hi.")
    cache = kv_cache.make_cache(model)
    model(mx.array([ids]), cache=cache)
    snap = kv_cache.snapshot(cache, len(ids))
    stuck, release = threading.Event(), threading.Event()
    write = kv_file.write

    def slow_write(*args: Any) -> None:   # a disk that does not answer until released
        stuck.set()
        release.wait()
        write(*args)

    monkeypatch.setattr(kv_file, "write", slow_write)
    disk = disks(queue_entries=2)
    results: list[bool] = []

    def submit_many() -> None:
        for i in range(10):
            results.append(disk.submit("static", "ns", "target", ids[: len(ids) - i],
                                       kv_cache.snapshot(cache, len(ids) - i)))

    assert disk.submit("static", "ns", "target", ids + [1], snap)
    assert stuck.wait(30)                 # the writer holds the first, waiting on the disk
    submitter = threading.Thread(target=submit_many)
    submitter.start()
    submitter.join(30)
    blocked = submitter.is_alive()
    release.set()
    assert not blocked, "submit waited for the disk"
    assert results == [True, True] + [False] * 8
    assert disk.flush(30)
    stats = disk.snapshot_stats()
    assert stats.write_drops == 8 and stats.writes == 3 and stats.entries == 3


_OTHER_PROCESS = """
import json, sys
from engine_adapter.mlx_engine import GenerationRequest, MLXEngine
folder, kv_dir, ids, end = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])
with MLXEngine.load(folder, kv_disk_dir=kv_dir, kv_disk_bytes=1 << 30,
                    reuse_conversation_kv=False) as engine:
    first = list(engine.generate(GenerationRequest(ids, max_tokens=2,
                                                   specprefill_system_end=end)))[0]
    print(json.dumps({"reused": first.prefill.reused_tokens,
                      "disk_hits": engine.snapshot_stats().kv_disk.hits}), flush=True)
# The interpreter then exits as any server's does (mlx_engine.mlx_streams releases the engine's and
# the disk writer's mlx streams on their threads, the main thread's at exit).
"""


def _other_process(folder: Path, kv_dir: Path, ids: list[int], end: int) -> dict[str, int]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", _OTHER_PROCESS, str(folder), str(kv_dir),
                          json.dumps(ids), str(end)], env=env, cwd=REPO, capture_output=True,
                         text=True, timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_process_that_ran_the_engine_exits_cleanly(tiny_model_dir, tmp_path, qwen3):
    """Generation with the disk tier on, the engine closed, then a plain interpreter exit: exit
    code 0 every time (mlx's streams left to its own teardown once aborted the process,
    "terminate called without an active exception")."""
    ids, end = turn(qwen3, 32, "Hello.")
    for attempt in range(3):
        out = _other_process(tiny_model_dir, tmp_path / "kv", ids, end)  # check=True: exit 0
        assert out["reused"] == (0 if attempt == 0 else end)


def test_two_engine_processes_share_the_folder(tiny_model_dir, tmp_path, qwen3):
    kv_dir = tmp_path / "kv"
    ids, end = turn(qwen3, 30, "Hello.")
    others, oend = turn(qwen3, 31, "Hello.")
    with MLXEngine.load(tiny_model_dir, kv_disk_dir=kv_dir, kv_disk_bytes=GIB,
                        reuse_conversation_kv=False) as engine:
        # Another process starts after this one: it finds nothing, computes, writes.
        assert _other_process(tiny_model_dir, kv_dir, others, oend) == {"reused": 0,
                                                                          "disk_hits": 0}
        # This one (started first, its scan found nothing) reads the other's finished file.
        events = run(engine, others, oend)
        assert events[0].prefill.reused_tokens == oend
        assert engine.snapshot_stats().kv_disk.hits == 1
        run(engine, ids, end)
        engine.kv_disk.flush()
        # A third process reads what this one wrote.
        assert _other_process(tiny_model_dir, kv_dir, ids, end) == {"reused": end,
                                                                   "disk_hits": 1}
        # An eviction by another process (here: a purge of the folder) is a miss, not an error.
        for path in files(kv_dir):
            path.unlink()
        engine.kv_store.purge()   # RAM and the index: the files are gone already
        events = run(engine, ids, end)
        assert events[0].prefill.reused_tokens == 0
        assert engine.snapshot_stats().kv_disk.discarded == 0
    assert kv_dir in kv_disk_folder(tiny_model_dir, kv_dir).parents


def test_purge_removes_a_namespaces_files(engines, disks, target, tmp_path):
    _, tok = target
    ids, end = turn(tok, 20, "Hello.")
    engine = engines(kv_disk=disks())
    for ns in ("tenant-a", "tenant-b"):
        run(engine, ids, end, namespace=ns)
    engine.kv_disk.flush()
    assert len(files(tmp_path / "kv")) == 4           # static + conversation, per tenant
    assert MLXBackend(engine, tok).purge_kv("tenant-a") == 4   # 2 in RAM, 2 files
    assert len(files(tmp_path / "kv")) == 2
    engine = restart(engines, disks, engine)
    assert run(engine, ids, end, namespace="tenant-a")[0].prefill.reused_tokens == 0
    assert run(engine, ids, end, namespace="tenant-b")[0].prefill.reused_tokens > end


def test_the_folder_stays_within_its_bytes_under_churn(engines, disks, target, tmp_path):
    _, tok = target
    probe = engines(kv_disk=disks(), reuse_conversation_kv=False)
    ids, end = turn(tok, 20, "Hello.")
    run(probe, ids, end)
    probe.kv_disk.flush()
    (one,) = files(tmp_path / "kv")
    bound = int(one.stat().st_size * 3.5)
    probe.close()
    assert probe.kv_disk.purge() == 1
    disk = disks(bound)
    engine = engines(kv_disk=disk, reuse_conversation_kv=False)
    for i in range(12):
        run(engine, ids, end, namespace=f"t{i}")
        disk.flush()
        on_disk = sum(p.stat().st_size for p in files(tmp_path / "kv"))
        assert on_disk <= bound and disk.nbytes == on_disk
    assert len(files(tmp_path / "kv")) == 3 and disk.snapshot_stats().evictions == 9
    # The most recent ones survive a restart; the least recently used went first.
    engine = restart(engines, disks, engine, reuse_conversation_kv=False)
    assert run(engine, ids, end, namespace="t11")[0].prefill.reused_tokens == end
    assert run(engine, ids, end, namespace="t0")[0].prefill.reused_tokens == 0


def test_cached_tokens_after_a_restart_count_the_tokens_from_disk(engines, disks, target):
    model, tok = target
    ids, end = turn(tok, 30, "Hello.")

    async def usage(engine: MLXEngine) -> Any:
        backend = MLXBackend(engine, tok)
        request = BackendRequest(ids, end, sampling=SamplingParams(max_tokens=2))
        outputs = [o async for o in backend.generate(backend.check(request))]
        return outputs[-1].usage

    engine = engines(kv_disk=disks())
    assert asyncio.run(usage(engine)).cached_tokens == 0
    engine = restart(engines, disks, engine)
    assert asyncio.run(usage(engine)).cached_tokens == len(ids) - 1 > end


def test_the_engine_options_turn_the_disk_tier_on_by_default_and_off_with_zero():
    assert EngineOptions.parse(None).engine_kwargs()["kv_disk_bytes"] > 0
    off = EngineOptions.parse({"kv_disk_bytes": 0}).engine_kwargs()
    assert off["kv_disk_bytes"] == 0
    no_stores = EngineOptions.parse({"kv_bytes": 0, "conversation_bytes": 0})
    assert no_stores.engine_kwargs()["kv_disk_bytes"] == 0
    chosen = EngineOptions.parse({"kv_disk_dir": "/tmp/kv", "kv_disk_bytes": "2GiB"})
    assert chosen.engine_kwargs()["kv_disk_dir"] == "/tmp/kv"
    assert chosen.engine_kwargs()["kv_disk_bytes"] == 2 * GIB
    with pytest.raises(ValueError, match="kv_disk_bytes"):
        EngineOptions.parse({"kv_disk_bytes": -1})


def test_the_default_folder_is_per_model_under_the_cache_folder(tmp_path, monkeypatch,
                                                                tiny_model_dir):
    monkeypatch.setenv("PREFIX_CACHE_HOME", str(tmp_path))
    folder = kv_disk_folder(tiny_model_dir)
    assert folder.parent == tmp_path / "engine-kv"
    assert folder.name.startswith(tiny_model_dir.name + "-")
    assert kv_disk_folder(tmp_path / "other" / tiny_model_dir.name) != folder
    with MLXEngine.load(tiny_model_dir, kv_disk_bytes=GIB) as engine:
        assert engine.kv_disk is not None and engine.kv_disk.root == folder
    with MLXEngine.load(tiny_model_dir, kv_disk_bytes=0) as engine:
        assert engine.kv_disk is None


def test_load_fingerprints_the_weights_not_the_folder_name(tmp_path, engine_models_dir):
    load_tiny(engine_models_dir, "qwen3")
    folder = engine_models_dir / "qwen3-64x2"
    before = folder_fingerprint(folder)
    weights = folder / "model.safetensors"
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in folder.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    assert folder_fingerprint(copy) == before      # the same weights elsewhere
    data = bytearray((copy / weights.name).read_bytes())
    data[-1] ^= 0xFF
    (copy / weights.name).write_bytes(bytes(data))
    assert folder_fingerprint(copy) != before      # other weights, same name


def test_folders_are_private_and_an_unknown_model_is_not_written(disks, target, tmp_path):
    from engine_adapter.mlx_engine.kv import cache as kv_cache

    model, tok = target
    ids, _ = turn(tok, 5, "Hi.")
    cache = kv_cache.make_cache(model)
    model(mx.array([ids]), cache=cache)
    disk = disks()
    assert not disk.submit("static", "ns", "draft", ids, kv_cache.snapshot(cache, len(ids)))
    assert disk.submit("static", "ns", "target", ids, kv_cache.snapshot(cache, len(ids)))
    assert disk.flush()
    (path,) = files(tmp_path / "kv")
    for folder in (path.parent, path.parents[1], path.parents[2], tmp_path / "kv"):
        assert folder.stat().st_mode & 0o777 == 0o700
    assert path.stat().st_mode & 0o777 == 0o600
    assert disk.snapshot_stats().write_errors == 0


LAYERED = ["gemma3_text", "gpt_oss", "qwen3_next", "qwen3_5"]   # windows, recurrent state


@pytest.mark.parametrize("arch", LAYERED)
def test_layered_snapshots_come_back_from_disk_after_a_restart(arch, engines, disks, tmp_path,
                                                               engine_models_dir, qwen3):
    """Sliding-window and recurrent families: their static prefix and conversation are
    written as layered files (0600) and restored whole after a restart; every decode step
    equals a dense forward."""
    model, tok = load_tiny(engine_models_dir, arch), qwen3
    fingerprints = {"target": kv_file.model_fingerprint(model)}

    def start(old: MLXEngine | None = None) -> MLXEngine:
        if old is not None:
            old.close()
            old.kv_disk.close()
        return engines(model, kv_disk=disks(fingerprints=fingerprints))

    first, end = turn(tok, 12, "What is in the workspace?")
    engine = start()
    assert run(engine, first, end)[0].prefill.reused_tokens == 0
    engine = start(engine)
    second = next_turn(tok, first, "A README.", "Open it.")
    events = run(engine, second, end, max_tokens=4)
    assert events[0].prefill.conversation_tokens == len(first) - 1, arch
    assert_matches_dense(model, second, events)
    engine = start(engine)
    other, _ = turn(tok, 12, "Something else entirely.")
    events = run(engine, other, end, max_tokens=4)
    assert events[0].prefill.reused_tokens == end, arch     # the static prefix, from disk
    assert_matches_dense(model, other, events)
    stats = engine.snapshot_stats().kv_disk
    assert stats.discarded == 0 and stats.write_errors == 0 and stats.hits >= 1
    for path in files(tmp_path / "kv"):
        assert path.stat().st_mode & 0o777 == 0o600


def test_files_another_process_wrote_are_indexed_within_the_bound(disks, target, tmp_path):
    from engine_adapter.mlx_engine.kv import cache as kv_cache

    model, tok = target
    ids, _ = turn(tok, 5, "Hi.")
    cache = kv_cache.make_cache(model)
    model(mx.array([ids]), cache=cache)
    prefixes = [ids[:len(ids) - i] for i in range(3)]
    size = kv_cache.snapshot(cache, len(ids)).nbytes
    reader = disks(int(size * 1.5))       # scanned an empty folder; room for one file
    writer = disks()                      # stands for another process
    for prefix in prefixes:
        assert writer.submit("static", "ns", "target", prefix, kv_cache.snapshot(cache, len(prefix)))
    assert writer.flush()
    assert len(files(tmp_path / "kv")) == 3
    for prefix in prefixes:               # the reader finds each by its path, and indexes it
        assert reader.get("static", "ns", "target", prefix) is not None
    assert reader.snapshot_stats().hits == 3
    # Within its bound: what it evicted to index the next one is deleted.
    assert len(reader) == 1 and len(files(tmp_path / "kv")) == 1
