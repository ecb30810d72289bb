"""The KV stores' prefix index: the longest stored prefix found in a radix tree gives the answer
the scan of every entry gave (entry, length, most recent on a tie), through puts, evictions,
supersedes, uses and purges; and it stays within its scope (namespace and model)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("mlx.core")

from engine_adapter.mlx_engine.kv.store import KVSnapshotStore, PrefixIndex  # noqa: E402
from prefix_cache.cache.boundary import packed_prefix_len  # noqa: E402
from prefix_cache.util.token_ids import pack_ids  # noqa: E402


@dataclass(frozen=True)
class Blob:
    """A stand-in snapshot: the store only needs ``nbytes``."""

    nbytes: int
    tag: int


def scan(store: KVSnapshotStore, namespace: str, model: str, ids: list[int], max_tokens: int,
         min_tokens: int) -> tuple[int, Any] | None:
    """The lookup as it was before the index: every entry compared, most recent first."""
    if max_tokens <= min_tokens:
        return None
    packed = pack_ids(ids[:max_tokens])
    best, best_n = None, min_tokens
    for entry_ns, entry_model, entry_ids, snapshot in reversed(store.entries()):
        if (entry_ns, entry_model) != (namespace, model):
            continue
        n = packed_prefix_len(packed, entry_ids)
        if n > best_n:
            best, best_n = snapshot, n
    return None if best is None else (best_n, best)


ids_st = st.lists(st.integers(0, 2), max_size=10)   # three ids: many shared prefixes
scope_st = st.tuples(st.sampled_from(["a", "b"]), st.sampled_from(["target", "draft"]))
op_st = st.one_of(
    st.tuples(st.just("put"), scope_st, ids_st, st.integers(1, 40), st.booleans()),
    st.tuples(st.just("get"), scope_st, ids_st),
    st.tuples(st.just("lcp"), scope_st, ids_st, st.integers(0, 12), st.integers(0, 3)),
    st.tuples(st.just("purge"), st.sampled_from(["a", "b", None])),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(op_st, max_size=60))
def test_the_index_answers_as_the_scan_of_every_entry(ops):
    store = KVSnapshotStore(100)   # small: puts evict
    for i, op in enumerate(ops):
        if op[0] == "put":
            _, (ns, model), ids, size, supersede = op
            store.put(ns, model, ids, Blob(size, i), supersede=supersede)
        elif op[0] == "get":
            _, (ns, model), ids = op
            store.get(ns, model, ids)
        elif op[0] == "lcp":
            _, (ns, model), ids, max_tokens, min_tokens = op
            want = scan(store, ns, model, ids, max_tokens, min_tokens)
            assert store.longest_common_prefix(ns, model, ids, max_tokens, min_tokens) == want
        else:
            store.purge(op[1])
        assert store.indexed == len(store)


def test_a_tie_goes_to_the_most_recently_used_and_removal_hands_it_on():
    index: PrefixIndex[str] = PrefixIndex()
    for key, ids in (("x", [1, 2, 3, 4]), ("y", [1, 2, 3, 5]), ("z", [1, 2, 6])):
        index.insert(key, "s", pack_ids(ids))
    assert index.longest("s", pack_ids([1, 2, 3, 7])) == (3, "y")   # y newer than x
    index.touch("x")
    assert index.longest("s", pack_ids([1, 2, 3, 7])) == (3, "x")
    assert index.longest("s", pack_ids([1, 9])) == (1, "x")         # the whole tree ties
    index.remove("x")
    assert index.longest("s", pack_ids([1, 9])) == (1, "z")
    assert index.longest("s", pack_ids([1, 2, 3, 4, 8])) == (3, "y")  # x is gone: y shares 3
    assert index.longest("t", pack_ids([1, 2])) is None             # another scope: nothing
    assert index.longest("s", pack_ids([7])) is None
    assert index.prefixes("s", pack_ids([1, 2, 6, 0])) == ["z"]
    for key in ("y", "z"):
        index.remove(key)
    assert len(index) == 0 and index.longest("s", pack_ids([1, 2])) is None


lru_op_st = st.one_of(
    st.tuples(st.just("put"), st.sampled_from("st"), ids_st, st.integers(1, 40)),
    st.tuples(st.just("get"), st.sampled_from("st"), ids_st),
    st.tuples(st.just("pop"), st.sampled_from("st"), ids_st),   # the disk tier drops bad files
    st.tuples(st.just("prefixes"), st.sampled_from("st"), ids_st),
    st.tuples(st.just("longest"), st.sampled_from("st"), ids_st),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(lru_op_st, max_size=60))
def test_the_indexed_lru_answers_as_a_scan_whatever_it_drops(ops):
    from engine_adapter.mlx_engine.kv.store import PrefixLRU

    lru: PrefixLRU[tuple[str, bytes], bytes] = PrefixLRU(100, lambda k: k[0], lambda v: v)
    for op in ops:
        kind, scope, ids = op[:3]
        key, packed = (scope, pack_ids(ids)), pack_ids(ids)
        if kind == "put":
            lru.put(key, packed, op[3])
        elif kind == "get":
            lru.get(key)
        elif kind == "pop":
            lru.pop(key)
        elif kind == "prefixes":
            want = [k for k, v in reversed(list(lru.items())) if k[0] == scope
                    and packed.startswith(v) and k != key]
            assert sorted(lru.pop_prefixes(scope, packed, keep=key)) == sorted(
                (k, k[1]) for k in want)
        else:
            best, best_n = None, 0
            for k, v in reversed(list(lru.items())):
                n = packed_prefix_len(packed, v)
                if k[0] == scope and n > best_n:
                    best, best_n = k, n
            found = lru.longest(scope, packed)
            assert (found[:2] if found else None) == (None if best is None else (best_n, best))
        assert len(lru.index) == len(lru)
