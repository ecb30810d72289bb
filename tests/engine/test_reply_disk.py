"""A reply's KV on the disk tier: a finished sequence's prompt and generated tokens are written
with where the generated part starts (``reply_from``, kv_file version 3), so after a restart (a
new engine on the same folder) the next turn that sends the reply back restores it from disk,
counts it as generated tokens reused, and every decode step equals an uncached dense run, per
family (dense, sliding-window, hybrid recurrent; after a SpecPrefill too). A version 2 file
(written before ``reply_from``) still reads, its tokens counted as prompt; a file whose
``reply_from`` does not fit its ids is refused and recomputed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

from engine_adapter.mlx_engine import MLXEngine, SpecPrefillConfig  # noqa: E402
from engine_adapter.mlx_engine.kv import file as kv_file  # noqa: E402
from engine_adapter.mlx_engine.kv.folder import TierFolder  # noqa: E402
from engine_adapter.testing.reference import masked_logprobs  # noqa: E402
from engine_adapter.testing.tiny_model import FAMILIES  # noqa: E402
from tests.engine.test_kv_disk_faults import rel_of, rewrite  # noqa: E402
from tests.engine.test_reply_reuse import first_turn, send_back  # noqa: E402
from tests.engine.test_specprefill import expected_kept, prompt  # noqa: E402
from tests.support.engine_fixtures import (  # noqa: E402
    assert_close,
    assert_matches_dense,
    files,
    load_tiny,
    run,
)


def restarted(engines: Any, disks: Any, model: Any, old: MLXEngine | None = None,
              **options: Any) -> MLXEngine:
    """A new engine on ``model`` over a new disk store of the test's folder (``old`` closed
    first, its writes finished): nothing of ``old``'s RAM is left."""
    if old is not None:
        old.close()
        old.kv_disk.close()
    fingerprints = {"target": kv_file.model_fingerprint(model)}
    return engines(model, kv_disk=disks(fingerprints=fingerprints), **options)


def reply_file(root: Path, n_ids: int) -> Path:
    """The conversation file holding ``n_ids`` ids (the finished turn's prompt and reply)."""
    found = []
    for path in files(root / "conversation"):
        with path.open("rb") as fh:
            meta = kv_file.read_header(fh)
        if len(kv_file.check_header(meta, {meta["model_id"]: meta["fingerprint"]})
               .packed_ids) // 4 == n_ids:
            found.append(path)
    (path,) = found
    return path


@pytest.mark.parametrize("arch", ["qwen3", "llama", *FAMILIES])
def test_after_a_restart_the_reply_comes_from_disk_counted_and_matches_dense(
        arch, engines, disks, engine_models_dir, qwen3):
    model, tok = load_tiny(engine_models_dir, arch), qwen3
    engine = restarted(engines, disks, model)
    first, end, reply = first_turn(engine, tok)
    engine = restarted(engines, disks, model, engine)
    second = send_back(tok, first, reply, "Open the README.")
    events = run(engine, second, end, max_tokens=6)
    info = events[0].prefill
    assert info.conversation_tokens == info.reused_tokens == len(first) + len(reply), arch
    assert info.reply_tokens == len(reply) >= 0.8 * len(reply)       # all of it, from disk
    assert_matches_dense(model, second, events)
    stats = engine.snapshot_stats()
    assert stats.reused_generated_tokens == len(reply)
    assert stats.kv_disk.hits >= 1 and stats.kv_disk.discarded == 0


def test_after_a_specprefill_the_sparse_history_and_dense_reply_come_from_disk(
        engines, disks, target, draft):
    model, tok = target
    config = SpecPrefillConfig(keep_pct=0.1, threshold=40, chunk_size=8, tail_tokens=8)
    options = {"draft_model": draft, "specprefill": config}
    engine = restarted(engines, disks, model, **options)
    first, end = prompt(tok, 120)
    kept = set(expected_kept(draft, first, end, config))
    events = run(engine, first, end, max_tokens=8)
    assert events[0].prefill.mode == "specprefill"
    reply = [e.token for e in events]
    engine = restarted(engines, disks, model, engine, **options)
    second = send_back(tok, first, reply, "Go on.")
    events = run(engine, second, end, max_tokens=4)
    info = events[0].prefill
    assert info.conversation_tokens == len(first) + len(reply)
    assert info.reply_tokens == len(reply)
    assert engine.snapshot_stats().kv_disk.hits >= 1
    # The kept tokens stand for turn 1's prompt; its last token, the reply and all after it
    # are dense (positions, span and keep share came back with the file).
    visible = [i < end or i in kept or i >= len(first) - 1 for i in range(len(second))]
    tokens = [e.token for e in events]
    for k, event in enumerate(events):
        assert_close(event.logprobs, masked_logprobs(model, second + tokens[:k],
                                                     visible + [True] * k))


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_next"])
def test_a_version_2_file_still_reads_its_tokens_counted_as_prompt(arch, engines, disks,
                                                                   engine_models_dir, qwen3,
                                                                   tmp_path):
    model, tok = load_tiny(engine_models_dir, arch), qwen3
    engine = restarted(engines, disks, model)
    first, end, reply = first_turn(engine, tok)
    engine.close()
    engine.kv_disk.close()
    path = reply_file(tmp_path / "kv", len(first) + len(reply))
    arrays, meta = mx.load(str(path), return_metadata=True)
    assert meta["version"] == "3" and meta["reply_from"] == str(len(first))
    # As version 2 wrote it: no reply_from field, its own checksum.
    old = {k: v for k, v in meta.items() if k != "reply_from"} | {"version": "2"}
    old["checksum"] = kv_file.checksum(arrays, old)
    path.unlink()
    kv_file.write(TierFolder(tmp_path / "kv"), rel_of(tmp_path / "kv", path), arrays, old)
    engine = restarted(engines, disks, model)
    second = send_back(tok, first, reply, "Open the README.")
    events = run(engine, second, end, max_tokens=4)
    info = events[0].prefill
    assert info.conversation_tokens == len(first) + len(reply), arch
    assert info.reply_tokens == 0            # not known to be generated: never over-counted
    assert_matches_dense(model, second, events)
    assert engine.snapshot_stats().kv_disk.discarded == 0


@pytest.mark.parametrize("reply_from", ["0", "9999", "-3", "x"])
def test_a_reply_from_that_does_not_fit_its_ids_is_refused_and_recomputed(
        reply_from, engines, disks, target, tmp_path):
    model, tok = target
    engine = restarted(engines, disks, model)
    first, end, reply = first_turn(engine, tok)
    engine.close()
    engine.kv_disk.close()
    path = reply_file(tmp_path / "kv", len(first) + len(reply))
    rewrite(tmp_path / "kv", path, rechecksum=True, reply_from=reply_from)
    engine = restarted(engines, disks, model)
    second = send_back(tok, first, reply, "Open the README.")
    events = run(engine, second, end, max_tokens=4)
    info = events[0].prefill
    assert info.reply_tokens == 0 and info.conversation_tokens < len(first) + len(reply)
    assert_matches_dense(model, second, events)
    assert engine.snapshot_stats().kv_disk.discarded == 1 and not path.exists()
