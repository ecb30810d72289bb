"""The KV disk tier under faults (docs/reliability.md's fault table): files damaged, edited,
planted or swapped for links and FIFOs; folders deleted, swapped or open to others; weights
changed in place; a full filesystem; a writer killed mid-write. Each gives the right tokens or
a recompute, never a wrong answer or an error, and nothing is written or left outside the tier.
Two processes sharing a folder: ``test_kv_disk.py::test_two_engine_processes_share_the_folder``.
"""

from __future__ import annotations

import base64
import os
import select
import shutil
import signal
import stat
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

from engine_adapter.mlx_engine.kv import cache as kv_cache, file as kv_file  # noqa: E402
from engine_adapter.mlx_engine.kv.folder import KVFolderError, TierFolder  # noqa: E402
from engine_adapter.mlx_engine.specprefill import SpecPrefillConfig  # noqa: E402
from prefix_cache.util.token_ids import pack_ids  # noqa: E402
from tests.support.engine_fixtures import (  # noqa: E402  # noqa: E402
    GIB,
    assert_close,
    assert_matches_dense,
    files,
    restart,
    run,
    snapshot_of,
    turn,
)
from tests.support.paths import REPO  # noqa: E402


def rel_of(root: Path, path: Path) -> str:
    return str(path.relative_to(root))


def rewrite(root: Path, path: Path, *, rechecksum: bool = False, **changes: str) -> None:
    """Rewrite a KV file with some metadata fields changed (its checksum kept as it was, or
    computed again to look consistent)."""
    arrays, meta = mx.load(str(path), return_metadata=True)
    meta = {**meta, **changes}
    if rechecksum:
        meta["checksum"] = kv_file.checksum(arrays, meta)
    path.unlink()
    kv_file.write(TierFolder(root), rel_of(root, path), arrays, meta)


# -- damaged files (these held before: kept as the suite's baseline) -------------------------

def _damage(root: Path, path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "bit-flip":          # a flipped byte in the KV itself: only the checksum sees it
        path.write_bytes(data[:-9] + bytes([data[-9] ^ 0xFF]) + data[-8:])
    elif how == "truncated":
        path.write_bytes(data[: len(data) * 2 // 3])
    elif how == "garbage":
        path.write_bytes(os.urandom(len(data)))
    elif how == "wrong-model":     # another model's KV: its fingerprint differs
        rewrite(root, path, rechecksum=True, fingerprint="another model")
    else:                          # a format older than any this version reads
        rewrite(root, path, rechecksum=True, version=str(int(kv_file.READS[0]) - 1))


@pytest.mark.parametrize("how", ["bit-flip", "truncated", "garbage", "wrong-model",
                                 "old-version"])
def test_a_damaged_file_is_deleted_and_its_kv_computed_again(engines, disks, target, tmp_path,
                                                             fingerprints, how):
    model, tok = target
    ids, end = turn(tok, 30, "Hello.")
    engine = engines(kv_disk=disks(), reuse_conversation_kv=False)
    run(engine, ids, end)
    engine = restart(engines, disks, engine, reuse_conversation_kv=False)
    (path,) = files(tmp_path / "kv")
    _damage(tmp_path / "kv", path, how)
    engine = restart(engines, disks, engine, reuse_conversation_kv=False)
    events = run(engine, ids, end, max_tokens=4)
    assert events[0].prefill.reused_tokens == 0           # recomputed, not a wrong answer
    assert_matches_dense(model, ids, events)
    assert engine.snapshot_stats().kv_disk.discarded == 1
    engine.kv_disk.flush()
    (rewritten,) = files(tmp_path / "kv")                  # the recomputed KV, written anew
    folder = TierFolder(tmp_path / "kv")
    assert kv_file.load(folder, rel_of(tmp_path / "kv", rewritten), fingerprints)[1].n_tokens == end


def test_another_namespaces_file_planted_at_a_tenants_path_is_never_served(disks, target,
                                                                          tmp_path):
    model, tok = target
    ids, _ = turn(tok, 10, "Hi.")
    disk = disks()
    assert disk.submit("static", "acme", "target", ids, snapshot_of(model, ids))
    assert disk.flush()
    (acme,) = files(tmp_path / "kv")
    globex = disk.path(disk.key("static", "globex", "target", pack_ids(ids)))
    globex.parent.mkdir(parents=True, mode=0o700)
    shutil.copy(acme, globex)
    again = disks()                       # the scan: not where its metadata says, deleted
    assert again.snapshot_stats().discarded == 1 and not globex.exists()
    shutil.copy(acme, globex)             # planted while running: the lookup refuses it
    assert again.get("static", "globex", "target", ids) is None
    assert again.snapshot_stats().discarded == 2 and not globex.exists()
    assert again.get("static", "acme", "target", ids) is not None


# -- edited metadata ---------------------------------------------------------------------------

def _sparse_file(disks: Any, model: Any, ids: list[int]) -> Any:
    cache = kv_cache.make_cache(model)
    model(mx.array([ids]), cache=cache)
    positions = tuple(range(0, 2 * (len(ids) // 2), 2))   # every other token, as if sparse
    snap = kv_cache.snapshot(cache, len(positions), positions=positions,
                             span=positions[-1] + 1, keep_pct=0.2)
    disk = disks()
    assert disk.submit("conversation", "ns", "target", ids[:snap.span], snap)
    assert disk.flush()
    return snap


@pytest.mark.parametrize("rechecksum", [False, True], ids=["checksum-kept", "checksum-redone"])
@pytest.mark.parametrize("field", ["keep_pct", "span", "positions", "n_tokens",
                                   "dense_tokens", "ids"])
def test_edited_metadata_of_a_sparse_file_is_never_restored(disks, target, tmp_path, field,
                                                            rechecksum):
    model, tok = target
    ids, _ = turn(tok, 10, "Hi.")
    snap = _sparse_file(disks, model, ids)
    (path,) = files(tmp_path / "kv")
    meta = mx.load(str(path), return_metadata=True)[1]
    shifted = tuple(p + 1 for p in snap.positions)
    edits = {"keep_pct": "0.9" if not rechecksum else "1.5",
             "span": str(snap.span + 1000) if not rechecksum else str(snap.span - 5),
             "positions": base64.b64encode(pack_ids(shifted)).decode(),
             "n_tokens": str(snap.n_tokens - 1),
             "dense_tokens": str(snap.dense_tokens + 3),
             "ids": base64.b64encode(pack_ids(ids[:snap.span - 1])).decode()}
    assert meta[field] != edits[field]
    rewrite(tmp_path / "kv", path, rechecksum=rechecksum, **{field: edits[field]})
    disk = disks()
    assert disk.longest_common_prefix("conversation", "ns", "target", ids, len(ids)) is None
    assert disk.get("conversation", "ns", "target", ids[:snap.span]) is None
    assert disk.snapshot_stats().discarded == 1 and files(tmp_path / "kv") == []


@pytest.mark.parametrize("arch", ["gemma3_text", "qwen3_next"])
def test_an_edited_layer_description_of_a_layered_file_is_never_restored(
        arch, disks, tmp_path, engine_models_dir, qwen3):
    import json

    from tests.support.engine_fixtures import load_tiny

    model = load_tiny(engine_models_dir, arch)
    ids, _ = turn(qwen3, 12, "Hi.")
    snap = snapshot_of(model, ids)
    fingerprints = {"target": "fp"}
    disk = disks(fingerprints=fingerprints)
    assert disk.submit("static", "ns", "target", ids, snap) and disk.flush()
    (path,) = files(tmp_path / "kv")
    kinds = json.loads(mx.load(str(path), return_metadata=True)[1]["layers"])
    for kind in kinds:   # a window moved, or a recurrent state said to be missing
        if kind["kind"] == "window":
            kind["offset"] -= 1
        elif kind["kind"] == "state":
            kind["present"] = [False] * len(kind["present"])
    rewrite(tmp_path / "kv", path, rechecksum=True, layers=json.dumps(kinds))
    again = disks(fingerprints=fingerprints)
    assert again.get("static", "ns", "target", ids) is None
    assert again.snapshot_stats().discarded == 1 and files(tmp_path / "kv") == []


def test_an_edited_span_in_a_specprefill_history_is_a_recompute_not_an_error(
        engines, disks, target, draft, tmp_path):
    """The issue's case: ``span`` edited made the next turn fail ("cannot restore 1599 tokens
    from a snapshot of 599"); now the file is refused and the turn is what an engine without
    the disk tier answers."""
    _, tok = target
    config = SpecPrefillConfig(keep_pct=0.2, threshold=40, chunk_size=8, tail_tokens=8)
    first, end = turn(tok, 20, " ".join(f"word{i}" for i in range(90)))
    second = first + tok.encode("Fine.<|im_end|>\n<|im_start|>user\nMore.<|im_end|>\n"
                                "<|im_start|>assistant\n")
    options = dict(draft_model=draft, specprefill=config, reuse_conversation_kv=True)
    engine = engines(kv_disk=disks(), **options)
    assert run(engine, first, end, max_tokens=1)[0].prefill.mode == "specprefill"
    engine = restart(engines, disks, engine, **options)
    sparse = [p for p in files(tmp_path / "kv")
              if mx.load(str(p), return_metadata=True)[1]["positions"]]
    assert len(sparse) == 1
    meta = mx.load(str(sparse[0]), return_metadata=True)[1]
    rewrite(tmp_path / "kv", sparse[0], span=str(int(meta["span"]) + 1000))
    engine = restart(engines, disks, engine, **options)
    events = run(engine, second, end, max_tokens=3)
    assert engine.snapshot_stats().kv_disk.discarded == 1
    assert events[0].prefill.conversation_tokens == 0
    plain = run(engines(**options), second, end, max_tokens=3)
    assert [e.token for e in events] == [e.token for e in plain]
    for ours, theirs in zip(events, plain, strict=True):
        assert_close(ours.logprobs, theirs.logprobs)


# -- links, FIFOs, and folders others could write ------------------------------------------------

@pytest.mark.parametrize("level", ["namespace", "hash"])
def test_a_link_in_place_of_a_folder_is_never_followed(disks, target, tmp_path, level):
    model, tok = target
    ids, _ = turn(tok, 10, "Hi.")
    other = ids[:-1]
    outside = tmp_path / "outside"
    outside.mkdir()
    disk = disks()
    assert disk.submit("static", "acme", "target", ids, snapshot_of(model, ids))
    assert disk.flush()
    target_path = disk.path(disk.key("static", "acme", "target", pack_ids(other)))
    folder = target_path.parents[1] if level == "namespace" else target_path.parent
    if folder.exists():
        shutil.rmtree(folder)
    folder.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    folder.symlink_to(outside, target_is_directory=True)
    # A reader does not follow it: a miss, nothing read or deleted there.
    (outside / target_path.name).write_bytes(b"not read")
    assert disk.get("static", "acme", "target", other) is None
    assert (outside / target_path.name).read_bytes() == b"not read"
    # A writer replaces the link with a real folder and writes inside the tier.
    assert disk.submit("static", "acme", "target", other, snapshot_of(model, other))
    assert disk.flush()
    assert not folder.is_symlink() and folder.is_dir()
    assert sorted(p.name for p in outside.iterdir()) == [target_path.name]
    assert target_path.is_file() and disk.snapshot_stats().write_errors == 0
    assert disks().get("static", "acme", "target", other) is not None


def test_purge_deletes_nothing_outside_the_tier(disks, target, tmp_path):
    model, tok = target
    ids, _ = turn(tok, 10, "Hi.")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious.safetensors").write_bytes(b"someone else's")
    disk = disks()
    for ns in ("acme", "globex"):
        assert disk.submit("static", ns, "target", ids, snapshot_of(model, ids))
    assert disk.flush()
    acme = disk.path(disk.key("static", "acme", "target", pack_ids(ids)))
    ns_folder = acme.parents[1]
    shutil.rmtree(ns_folder)
    ns_folder.symlink_to(outside, target_is_directory=True)
    assert disk.purge("static", "acme") == 1
    assert not ns_folder.exists() and not ns_folder.is_symlink()   # the link went, not its target
    assert (outside / "precious.safetensors").read_bytes() == b"someone else's"
    assert disk.purge() == 1 and files(tmp_path / "kv") == []
    assert (outside / "precious.safetensors").exists()


@pytest.mark.parametrize("how", ["group-writable", "world-writable-parent", "other-owner",
                                 "a-file"])
def test_a_tier_folder_others_could_write_is_refused_with_the_reason(disks, tmp_path, how):
    parent = tmp_path / "base"
    parent.mkdir(mode=0o755)
    root = parent / "kv"
    reason = {"group-writable": "group or others can write", "world-writable-parent":
              "group or others can write", "other-owner": "owned by uid 4242",
              "a-file": "not a folder"}[how]
    if how == "a-file":
        root.write_bytes(b"")
    else:
        root.mkdir(mode=0o700)
    if how == "group-writable":
        root.chmod(0o770)
    elif how == "world-writable-parent":
        parent.chmod(0o777)
    elif how == "other-owner":
        if os.geteuid() != 0:
            pytest.skip("making a folder another user's takes root")
        os.chown(root, 4242, 4242)
    with pytest.raises(KVFolderError, match=reason):
        disks(root=root)
    parent.chmod(0o755)
    link = tmp_path / "link"                     # a link to a sound folder is that folder
    good = tmp_path / "good"
    good.mkdir(mode=0o700)
    link.symlink_to(good, target_is_directory=True)
    assert disks(root=link).root == good.resolve()


def test_serve_engine_refuses_a_tier_folder_others_could_write(tiny_model_dir, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)                       # anyone may swap what is in it
    code = "import sys; from prefix_cache import cli; sys.exit(cli.main(sys.argv[1:]))"
    out = subprocess.run([sys.executable, "-c", code, "serve-engine", "--model",
                          str(tiny_model_dir), "--engine-option", f"kv_disk_dir={shared}"],
                         env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2
    assert f"KV disk folder {shared}: group or others can write it (mode 777)" in out.stderr


def test_a_fifo_named_like_a_kv_file_hangs_neither_the_start_nor_a_lookup(disks, target,
                                                                         tmp_path):
    model, tok = target
    ids, _ = turn(tok, 10, "Hi.")
    root = tmp_path / "kv" / "static" / "ns-0" / "ab"
    root.mkdir(parents=True)
    os.mkfifo(root / "stuck.safetensors")
    started: list[Any] = []
    thread = threading.Thread(target=lambda: started.append(disks()), daemon=True)
    thread.start()
    thread.join(60)
    assert started, "the start hung on a FIFO"
    disk = started[0]
    assert disk.snapshot_stats().discarded == 1 and not (root / "stuck.safetensors").exists()
    path = disk.path(disk.key("static", "acme", "target", pack_ids(ids)))
    path.parent.mkdir(parents=True, mode=0o700)
    os.mkfifo(path)
    found: list[Any] = []
    thread = threading.Thread(target=lambda: found.append(disk.get("static", "acme", "target",
                                                                    ids)), daemon=True)
    thread.start()
    thread.join(60)
    assert found == [None], "a lookup hung on a FIFO"
    assert disk.snapshot_stats().discarded == 2 and not path.exists()
    path.mkdir()                              # a folder in the file's place: a miss too
    assert disk.get("static", "acme", "target", ids) is None and not path.exists()
    assert disk.submit("static", "acme", "target", ids, snapshot_of(model, ids))
    assert disk.flush() and stat.S_ISREG(path.stat().st_mode)


# -- weights changed in place --------------------------------------------------------------------

def _triple_rows(weights: Path, rows: list[int]) -> None:
    """Triple some rows of the embedding in place, keeping the file's size and mtime."""
    import json
    import struct

    import numpy as np

    st = weights.stat()
    with open(weights, "r+b") as fh:
        (size,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(size))
        info = header["model.embed_tokens.weight"]
        assert info["dtype"] == "F32"
        width = info["shape"][1]
        for row in rows:
            at = 8 + size + info["data_offsets"][0] + row * width * 4
            fh.seek(at)
            values = np.frombuffer(fh.read(width * 4), dtype=np.float32) * 3
            fh.seek(at)
            fh.write(values.tobytes())
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert weights.stat().st_size == st.st_size


def test_weights_changed_in_place_are_never_served_stale_kv(tiny_model_dir, tmp_path, qwen3):
    from engine_adapter.mlx_engine import MLXEngine

    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    ids, end = turn(qwen3, 30, "Hello.")

    def serve() -> tuple[Any, list[Any]]:
        with MLXEngine.load(model_dir, kv_disk_dir=tmp_path / "kv", kv_disk_bytes=GIB,
                            reuse_conversation_kv=False) as engine:
            return engine, run(engine, ids, end, max_tokens=3)

    assert serve()[1][0].prefill.reused_tokens == 0
    assert serve()[1][0].prefill.reused_tokens == end          # the tier works
    _triple_rows(model_dir / "model.safetensors", sorted(set(ids[:end])))
    engine, events = serve()
    assert events[0].prefill.reused_tokens == 0                # stale KV refused
    assert engine.snapshot_stats().kv_disk.discarded == 1
    assert_matches_dense(engine.model, ids, events)


@pytest.mark.parametrize("changed", [False, True])
def test_weights_changed_while_the_engine_starts_turn_the_tier_off(tiny_model_dir, tmp_path,
                                                                   target, changed):
    """The tier is opened (the weights fingerprinted) before mlx-lm loads them; a weight file
    written in between could be loaded yet carry the old fingerprint, so the first use checks
    that none was, and the tier stays off for that process if one was."""
    from engine_adapter.mlx_engine.kv.disk_setup import open_kv_disk

    model, tok = target
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    ids, _ = turn(tok, 10, "Hi.")
    disk = open_kv_disk(model_dir, None, tmp_path / "kv", GIB)
    try:
        if changed:                          # written while the engine was loading it
            _triple_rows(model_dir / "model.safetensors", [5])
        assert disk.submit("static", "ns", "target", ids, snapshot_of(model, ids)) != changed
        assert disk.flush()
        assert (disk.get("static", "ns", "target", ids) is None) == changed
    finally:
        disk.close()
    assert len(files(disk.root)) == (0 if changed else 1)


def test_the_fingerprint_reads_every_byte_and_remembers_unchanged_files(tiny_model_dir,
                                                                       tmp_path):
    from engine_adapter.mlx_engine.kv import fingerprint as kv_fingerprint

    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    memo = tmp_path / "memo.json"
    before = kv_fingerprint.folder_fingerprint(model_dir, memo)
    assert memo.stat().st_mode & 0o777 == 0o600
    assert kv_fingerprint.folder_fingerprint(model_dir) == before     # memo or not
    _triple_rows(model_dir / "model.safetensors", [77_777])            # far from any sample
    changed = kv_fingerprint.folder_fingerprint(model_dir, memo)
    assert changed != before                                           # ctime changed: hashed
    # An unchanged file is not read again: a memo entry that lies is believed (that is why
    # the memo keys on ctime, which a user cannot set back).
    data = memo.read_text().replace(kv_fingerprint.file_digest(model_dir / "model.safetensors"),
                                    "0" * 32)
    memo.write_text(data)
    assert kv_fingerprint.folder_fingerprint(model_dir, memo) not in (before, changed)


# -- folders deleted, a full disk ----------------------------------------------------------------

@pytest.mark.parametrize("which", ["root", "namespace"])
def test_writing_resumes_after_the_folder_is_deleted(engines, disks, target, tmp_path, which):
    model, tok = target
    ids, end = turn(tok, 20, "Hello.")
    engine = engines(kv_disk=disks(), reuse_conversation_kv=False)
    run(engine, ids, end, namespace="a")
    engine.kv_disk.flush()
    (path,) = files(tmp_path / "kv")
    shutil.rmtree(tmp_path / "kv" if which == "root" else path.parents[1])
    assert run(engine, ids, end, namespace="a")[0].prefill.reused_tokens == end   # RAM's
    run(engine, ids, end, namespace="b")     # computed, and written into folders made again
    engine.kv_disk.flush()
    stats = engine.snapshot_stats().kv_disk
    assert stats.write_errors == 0 and len(files(tmp_path / "kv")) == 1
    assert (tmp_path / "kv").stat().st_mode & 0o777 == 0o700
    engine = restart(engines, disks, engine, reuse_conversation_kv=False)
    assert run(engine, ids, end, namespace="b")[0].prefill.reused_tokens == end
    assert run(engine, ids, end, namespace="a")[0].prefill.reused_tokens == 0


@pytest.fixture
def small_fs(tmp_path: Path) -> Any:
    """A 4 MiB tmpfs of this test's own (mount needs root: skipped without it)."""
    mount = tmp_path / "fs"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m,mode=0700", "tmpfs",
                           str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {done.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(fs: Path, leave: int) -> Path:
    """A filler file taking all of ``fs``'s free space but ``leave`` bytes."""
    filler = fs / "filler"
    free = os.statvfs(fs).f_bavail * os.statvfs(fs).f_frsize
    with open(filler, "ab") as fh:
        fh.write(b"\0" * max(0, free - leave))
    return filler


def test_a_full_disk_evicts_to_make_room_and_writing_resumes(engines, disks, target, small_fs):
    from engine_adapter.backend import MLXBackend
    from engine_adapter.server import create_engine_app
    from prefix_cache.metrics.engine import engine_exposition
    from tests.support.loopback import local_client
    from tests.support.server_thread import ServerThread

    model, tok = target
    prompts = [turn(tok, 8 + i, "Hi.")[0] for i in range(10)]
    size = snapshot_of(model, prompts[0]).nbytes
    disk = disks(root=small_fs / "kv")
    filler = fill(small_fs, leave=int(size * 3.5))   # room for about three files
    for ids in prompts:
        assert disk.submit("static", "ns", "target", ids, snapshot_of(model, ids))
        assert disk.flush()
    stats = disk.snapshot_stats()
    assert stats.writes == 10 and stats.write_errors == 0 and not stats.disk_full
    assert stats.evictions >= 5 and 1 <= stats.entries <= 4
    assert disk.get("static", "ns", "target", prompts[-1]) is not None   # the newest stay
    # Nothing of ours left to evict and still no room: reported, the answer still right.
    disk.purge()
    fill(small_fs, leave=0)
    engine = engines(kv_disk=disk, reuse_conversation_kv=False)
    ids, end = turn(tok, 30, "Hello.")
    events = run(engine, ids, end)
    disk.flush()
    assert_matches_dense(model, ids, events)
    assert disk.snapshot_stats().disk_full and disk.snapshot_stats().full_errors >= 1
    assert MLXBackend(engine, tok).health()["disk_full"] is True
    assert b'prefix_cache_engine_kv_disk_full{model="tiny"} 1.0' in engine_exposition(
        "tiny", engine)[0]
    app = create_engine_app(MLXBackend(engine, tok), close_engine=False)
    with ServerThread(app) as url, local_client(base_url=url) as http:
        health = http.get("/health")           # serve-engine's probe: still ready, and says it
    assert health.status_code == 200
    assert health.json() == {"status": "ok", "disk_full": True}
    # Room again: the next write succeeds by itself and clears the report.
    filler.unlink()
    engine.kv_store.purge()
    run(engine, ids, end)
    disk.flush()
    assert not disk.snapshot_stats().disk_full and not engine.health()["disk_full"]
    assert len(files(small_fs / "kv")) == 1
    assert [p for p in (small_fs / "kv").rglob("*") if p.name.startswith(".")] == []


# -- a writer killed mid-write -------------------------------------------------------------------

_KILLED_WRITER = """
import sys, time
import mlx.core as mx
from engine_adapter.mlx_engine.kv.cache import KVSnapshot
from engine_adapter.mlx_engine.kv.disk import DiskKVStore

def half_then_hang(fh, arrays, metadata):   # the process is killed in the middle of a file
    fh.write(b"\\0" * 4096)
    fh.flush()
    print("mid-write", flush=True)
    time.sleep(120)

mx.save_safetensors = half_then_hang
disk = DiskKVStore(sys.argv[1], 1 << 30, {"target": "fp"})
k = mx.zeros((1, 2, 8, 16))
mx.eval(k)
disk.submit("static", "ns", "target", list(range(8)), KVSnapshot(((k, k),), 8, 2 * k.nbytes))
time.sleep(120)
"""


def test_a_writer_killed_mid_write_leaves_no_file_and_its_temporary_file_is_cleaned(
        disks, tmp_path):
    root = tmp_path / "kv"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, str(root)], env=env,
                            cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 120)
        assert ready and proc.stdout.readline().strip() == "mid-write"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    temps = [p for p in root.rglob("*.safetensors") if p.name.startswith(".")]
    assert len(temps) == 1 and files(root) == []
    live = temps[0].with_name(f".x.{os.getpid()}.0000.tmp.safetensors")   # a running writer's
    live.write_bytes(b"\0" * 10)
    disk = disks(fingerprints={"target": "fp"})
    assert not temps[0].exists() and live.exists()     # the dead writer's only
    assert len(disk) == 0 and disk.snapshot_stats().discarded == 0
    k = mx.ones((1, 2, 8, 16))
    mx.eval(k)   # the writer thread reads the bytes; it has no stream to compute them on
    assert disk.submit("static", "ns", "target", list(range(8)),
                       kv_cache.KVSnapshot(((k, k),), 8, 2 * k.nbytes))
    assert disk.flush() and disk.get("static", "ns", "target", list(range(8))) is not None


def test_a_full_disk_without_a_tmpfs_evicts_at_the_write_seam(disks, target, tmp_path,
                                                             monkeypatch):
    """The same behaviour where ``mount`` is not allowed: the one write seam (``kv_file.write``)
    fails with ENOSPC while the folder holds three files, as a disk with room for three."""
    import errno

    model, tok = target
    write = kv_file.write

    def room_for_three(*args: Any) -> None:
        if len(files(tmp_path / "kv")) >= 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        write(*args)

    monkeypatch.setattr(kv_file, "write", room_for_three)
    disk = disks()
    prompts = [turn(tok, 8 + i, "Hi.")[0] for i in range(6)]
    for ids in prompts:
        assert disk.submit("static", "ns", "target", ids, snapshot_of(model, ids))
        assert disk.flush()
    stats = disk.snapshot_stats()
    assert stats.writes == 6 and stats.write_errors == 0 and stats.evictions >= 3
    assert disk.get("static", "ns", "target", prompts[-1]) is not None


def test_the_file_being_written_counts_in_the_tiers_bytes(disks, target, monkeypatch):
    model, tok = target
    ids, _ = turn(tok, 5, "Hi.")
    snap = snapshot_of(model, ids)
    writing, release = threading.Event(), threading.Event()
    write = kv_file.write

    def slow_write(*args: Any) -> None:
        writing.set()
        release.wait(30)
        write(*args)

    monkeypatch.setattr(kv_file, "write", slow_write)
    disk = disks()
    assert disk.submit("static", "ns", "target", ids, snap)
    assert writing.wait(30)
    during = disk.snapshot_stats().bytes
    release.set()
    assert disk.flush()
    assert during == snap.nbytes and 0 < disk.snapshot_stats().bytes == disk.nbytes


def test_no_tier_for_a_model_that_is_not_a_local_folder(tmp_path):
    """No weights here to fingerprint (a missing folder, a hub name): no KV trusted on disk,
    and no folder made for it."""
    from engine_adapter.mlx_engine.kv.disk_setup import open_kv_disk

    assert open_kv_disk(tmp_path / "missing", None, tmp_path / "kv", GIB) is None
    assert open_kv_disk("mlx-community/some-model", None, tmp_path / "kv", GIB) is None
    assert not (tmp_path / "kv").exists()
