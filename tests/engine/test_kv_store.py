"""The static-prefix KV store: LRU in bytes, exact-ids keys, namespaces that never share."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

pytest.importorskip("mlx.core")

from engine_adapter.mlx_engine.kv.store import KVSnapshotStore, prefix_key  # noqa: E402


@dataclass(frozen=True)
class Blob:
    """A stand-in snapshot: the store only needs ``nbytes``."""

    nbytes: int
    tag: str = ""


def tag(store: KVSnapshotStore, namespace: str, model: str, ids: list[int]) -> str:
    snap = store.get(namespace, model, ids)
    assert snap is not None, "expected a hit"
    return snap.tag


def test_get_returns_what_was_put_for_exactly_those_ids():
    store = KVSnapshotStore(1000)
    snap = Blob(10, "a")
    assert store.put("t1", "target", [1, 2, 3], snap)
    assert store.get("t1", "target", [1, 2, 3]) is snap
    assert store.get("t1", "target", [1, 2]) is None
    assert store.get("t1", "target", [1, 2, 3, 4]) is None
    assert store.get("t1", "target", [1, 2, 4]) is None
    assert store.stats.hits == 1 and store.stats.misses == 3


def test_namespaces_and_models_never_share_an_entry():
    store = KVSnapshotStore(1000)
    store.put("tenant-a", "target", [5, 6, 7], Blob(10, "a"))
    assert store.get("tenant-b", "target", [5, 6, 7]) is None
    assert store.get("tenant-a", "draft", [5, 6, 7]) is None
    store.put("tenant-b", "target", [5, 6, 7], Blob(10, "b"))
    assert tag(store, "tenant-a", "target", [5, 6, 7]) == "a"
    assert tag(store, "tenant-b", "target", [5, 6, 7]) == "b"
    assert len(store) == 2
    assert store.stats.by_namespace == {"tenant-a": 1, "tenant-b": 1}


def test_keys_differ_by_namespace_in_the_clear():
    (ns_a, _, digest_a), _ = prefix_key("a", "target", [1, 2])
    (ns_b, _, digest_b), _ = prefix_key("b", "target", [1, 2])
    assert (ns_a, ns_b) == ("a", "b") and digest_a == digest_b


def test_lru_evicts_least_recently_used_to_stay_within_bytes():
    store = KVSnapshotStore(100)
    store.put("n", "m", [1], Blob(40, "one"))
    store.put("n", "m", [2], Blob(40, "two"))
    assert store.get("n", "m", [1]) is not None        # [1] is now the most recently used
    store.put("n", "m", [3], Blob(40, "three"))        # 120 > 100: evicts [2]
    assert store.get("n", "m", [2]) is None
    assert tag(store, "n", "m", [1]) == "one"
    assert tag(store, "n", "m", [3]) == "three"
    assert store.nbytes == 80 and store.stats.evictions == 1


def test_replacing_an_entry_does_not_count_its_bytes_twice():
    store = KVSnapshotStore(100)
    store.put("n", "m", [1], Blob(60))
    store.put("n", "m", [1], Blob(70))
    assert store.nbytes == 70 and len(store) == 1 and store.stats.evictions == 0


def test_an_entry_larger_than_the_store_is_rejected_and_evicts_nothing(caplog):
    store = KVSnapshotStore(100)
    store.put("n", "m", [1], Blob(50))
    with caplog.at_level("WARNING", logger="engine_adapter.mlx_engine"):
        assert not store.put("n", "m", [2], Blob(101))
        assert not store.put("n", "m", [3], Blob(102))
    assert store.get("n", "m", [1]) is not None and store.stats.rejected == 2
    # The operator is told once what to raise, not once per prefix.
    assert [r.getMessage() for r in caplog.records] == [
        "a KV snapshot of 101 bytes is larger than the whole store (100 bytes) and is not kept; "
        "raise the store's size (engine option kv_bytes or conversation_bytes)"]


def test_purge_one_namespace():
    store = KVSnapshotStore(1000)
    store.put("a", "m", [1], Blob(10))
    store.put("a", "m", [2], Blob(10))
    store.put("b", "m", [1], Blob(10))
    assert store.purge("a") == 2
    assert len(store) == 1 and store.nbytes == 10
    assert store.stats.by_namespace == {"b": 1}


def test_longest_common_prefix_finds_prefixes_and_siblings_of_one_namespace():
    store = KVSnapshotStore(1000)
    store.put("n", "m", [1, 2, 3], Blob(10, "turn1"))
    store.put("n", "m", [1, 2, 3, 4, 5, 6], Blob(10, "turn2"))
    store.put("n", "m", [1, 2, 9, 9], Blob(10, "other"))
    store.put("x", "m", [1, 2, 3, 4, 5, 6, 7], Blob(10, "another tenant"))
    store.put("n", "d", [1, 2, 3, 4, 5, 6, 7], Blob(10, "another model"))
    hit = store.longest_common_prefix("n", "m", [1, 2, 3, 4, 5, 6, 7, 8], max_tokens=7)
    assert hit is not None and (hit[0], hit[1].tag) == (6, "turn2")      # extends turn 2
    hit = store.longest_common_prefix("n", "m", [1, 2, 3, 4, 7, 7], max_tokens=5)
    assert hit is not None and (hit[0], hit[1].tag) == (4, "turn2")      # a sibling: 4 shared
    hit = store.longest_common_prefix("n", "m", [1, 2, 3, 4, 5, 6, 7], max_tokens=3)
    assert hit is not None and hit[0] == 3                               # capped
    assert store.longest_common_prefix("n", "m", [1, 2, 3, 4], 3, min_tokens=3) is None
    assert store.longest_common_prefix("n", "m", [5, 1, 2, 3], max_tokens=3) is None
    assert store.longest_common_prefix("y", "m", [1, 2, 3, 4], max_tokens=3) is None
    hit = store.longest_common_prefix("n", "m", [1, 2, 3, 9], max_tokens=3)
    assert hit is not None and (hit[0], hit[1].tag) == (3, "turn2")      # a tie: most recent
    assert store.stats.hits == 4 and store.stats.misses == 2   # min >= max: no lookup at all


def test_supersede_drops_the_entries_a_new_one_extends_and_nothing_else():
    store = KVSnapshotStore(1000)
    store.put("n", "m", [1, 2], Blob(10, "turn1"))
    store.put("n", "m", [1, 2, 3, 4], Blob(10, "turn2"))              # plain put: both kept
    store.put("n", "m", [1, 2, 9], Blob(10, "sibling"))
    store.put("x", "m", [1, 2], Blob(10, "another tenant"))
    store.put("n", "d", [1, 2], Blob(10, "another model"))
    assert store.put("n", "m", [1, 2, 3, 4, 5], Blob(10, "turn3"), supersede=True)
    assert store.get("n", "m", [1, 2]) is None and store.get("n", "m", [1, 2, 3, 4]) is None
    assert tag(store, "n", "m", [1, 2, 9]) == "sibling"
    assert tag(store, "x", "m", [1, 2]) == "another tenant"
    assert tag(store, "n", "d", [1, 2]) == "another model"
    assert store.stats.superseded == 2 and store.stats.by_namespace == {"n": 3, "x": 1}
    assert len(store) == 4 and store.nbytes == 40
    hit = store.longest_common_prefix("n", "m", [1, 2, 3, 7], max_tokens=3)
    assert hit is not None and (hit[0], hit[1].tag) == (3, "turn3")   # what turn 2 gave before


def test_restore_of_a_shorter_prefix_and_views_for_the_batch():
    import mlx.core as mx

    from engine_adapter.mlx_engine.kv import cache as kv_cache

    c = kv_cache.PositionedKVCache()
    k = mx.arange(2 * 5 * 4, dtype=mx.float32).reshape(1, 2, 5, 4)
    c.update_and_fetch(k, k + 100)
    snap = kv_cache.snapshot([c], 4)
    for copy in (True, False):
        (part,) = kv_cache.restore(snap, 3, copy=copy)
        assert part.offset == 3 and kv_cache.cache_size([part]) == 3
        assert mx.array_equal(part.keys, k[..., :3, :]).item()
        assert mx.array_equal(part.values, k[..., :3, :] + 100).item()
    for bad in (0, 5):
        with pytest.raises(ValueError, match="cannot restore"):
            kv_cache.restore(snap, bad)


def test_a_sparse_snapshot_restores_the_stored_tokens_of_a_prefix_rotated_past_the_dropped():
    import mlx.core as mx

    from engine_adapter.mlx_engine.kv import cache as kv_cache

    c = kv_cache.PositionedKVCache()
    k = mx.arange(2 * 4 * 4, dtype=mx.float32).reshape(1, 2, 4, 4)
    c.update_and_fetch(k, k)
    # Four stored tokens standing for a 10-token prompt: positions 0, 1, 5, 6.
    snap = kv_cache.snapshot([c], 4, positions=[0, 1, 5, 6], span=10)
    assert snap.prompt_tokens == 10 and snap.positions_before(6) == (0, 1, 5)
    assert snap.dense_tokens == 2 and kv_cache.snapshot([c], 3).dense_tokens == 3
    assert kv_cache.snapshot([c], 3, positions=[0, 1, 2], span=9).dense_tokens == 3
    for n, stored in ((10, 4), (6, 3), (5, 2), (1, 1)):
        (part,) = kv_cache.restore(snap, n)
        assert kv_cache.cache_size([part]) == stored and part.position_shift == n - stored
        assert mx.array_equal(part.keys, k[..., :stored, :]).item()
    assert kv_cache.restore(snap)[0].position_shift == 6
    with pytest.raises(ValueError, match="cannot restore"):
        kv_cache.restore(kv_cache.snapshot([c], 2, positions=[3, 4], span=6), 3)   # nothing stored before 3
    for positions, span in (([0, 1, 2], 10), ([0, 2, 1, 3], 10), ([0, 1, 2, 9], 9)):
        with pytest.raises(ValueError, match="sparse snapshot"):
            kv_cache.snapshot([c], 4, positions=positions, span=span)   # 3 for 4, unordered, past span


@pytest.mark.parametrize("bad", [0, -1, 1.5, None])
def test_bad_size_is_refused(bad):
    with pytest.raises(ValueError, match="max_bytes"):
        KVSnapshotStore(bad)


def test_restore_is_a_deep_copy_that_writes_never_reach_the_snapshot():
    import mlx.core as mx

    from engine_adapter.mlx_engine.kv import cache as kv_cache

    c = kv_cache.PositionedKVCache()
    k = mx.arange(2 * 3 * 4, dtype=mx.float32).reshape(1, 2, 3, 4)
    c.update_and_fetch(k, k + 100)
    snap = kv_cache.snapshot([c], 2)
    assert snap.n_tokens == 2 and snap.nbytes == 2 * (2 * 2 * 4 * 4)
    restored = kv_cache.restore(snap)[0]
    restored.trim(1)                                    # a trim then a write is in place
    restored.update_and_fetch(mx.full((1, 2, 1, 4), -1.0), mx.full((1, 2, 1, 4), -1.0))
    assert mx.array_equal(snap.layers[0][0], k[..., :2, :]).item()
    fresh = kv_cache.restore(snap)[0].keys
    assert fresh is not None and mx.array_equal(fresh, k[..., :2, :]).item()
