"""KV lookup benchmark: the cost an admission pays in the conversation store's lookup, with 10,
1,000 and 100,000 stored entries, the radix tree against the scan of every entry it replaced,
side by side in one run.

    python bench/kv_lookup.py [--sizes 10,1000,100000] [--queries 200] [--update-docs]

Each stored entry is a conversation of one namespace: a shared static prefix (``--static``
tokens) and its own turns (``--turns`` tokens, random ids). Per size, three kinds of prompt
are looked up, cycling: a stored conversation's next turn (hit at its whole length), a new
conversation on the same static prefix (hit at the static prefix), another namespace's prompt
(miss); the first ``--scan-queries`` answers are checked against the old scan first. Timed per call (median),
the three stores taking turns query by query so the machine's load falls on each alike:
``KVSnapshotStore.longest_common_prefix`` (the index) and the scan as it was (every entry of
the store, most recent first, a memcmp binary search each, over the same store); and the
admission's store of its prompt, ``put(..., supersede=True)``, against the scan the old
supersede ran. The disk tier's lookup is the same ``PrefixLRU``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine_adapter.mlx_engine.kv.store import KVSnapshotStore  # noqa: E402
from prefix_cache.cache.boundary import packed_prefix_len  # noqa: E402
from prefix_cache.util.token_ids import pack_ids  # noqa: E402

DOCS = ROOT / "docs" / "benchmarks.md"
MARK_START, MARK_END = "<!-- bench:kv-lookup:start -->", "<!-- bench:kv-lookup:end -->"
VOCAB = 150_000
MODEL = "target"


@dataclass(frozen=True)
class Blob:
    """A snapshot as the store sees it: only its size."""

    nbytes: int


def old_scan(store: KVSnapshotStore, namespace: str, ids: list[int], max_tokens: int
             ) -> tuple[int, Any] | None:
    """The lookup before the index (kv_store.py at 5aff14f), over the same store."""
    packed = pack_ids(ids[:max_tokens])
    best, best_n = None, 0
    for key, entry in reversed(list(store._entries.items())):
        if key[0] != namespace or key[1] != MODEL:
            continue
        n = packed_prefix_len(packed, entry.packed_ids)
        if n > best_n:
            best, best_n = entry, n
    return None if best is None else (best_n, best.snapshot)


def old_supersede_scan(store: KVSnapshotStore, namespace: str, ids: list[int]) -> int:
    """The old supersede's pass: every entry tested as a prefix of the new ids."""
    packed = pack_ids(ids)
    return sum(1 for key, entry in store._entries.items()
               if key[0] == namespace and key[1] == MODEL and packed.startswith(entry.packed_ids))


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


@dataclass
class Stored:
    """One store of ``size`` conversations and the prompts to look up in it."""

    size: int
    store: KVSnapshotStore
    conv: Callable[[int], list[int]]
    queries: list[tuple[str, list[int]]]
    build_s: float


def build(size: int, args: argparse.Namespace) -> Stored:
    rng = random.Random(size)
    static = [rng.randrange(VOCAB) for _ in range(args.static)]
    store = KVSnapshotStore(1 << 50)

    def conv(i: int) -> list[int]:   # made again when needed: 100,000 lists would be GBs here
        own = random.Random(f"{size}-{i}")
        return static + [own.randrange(VOCAB) for _ in range(args.turns)]

    built = time.perf_counter()
    for i in range(size):
        store.put("tenant", MODEL, conv(i), Blob(1), supersede=True)
    built = time.perf_counter() - built
    queries = []
    for i in range(args.queries):
        tail = [rng.randrange(VOCAB) for _ in range(64)]
        kind = i % 3
        if kind == 0:
            queries.append(("tenant", conv(rng.randrange(size)) + tail))   # next turn
        elif kind == 1:
            queries.append(("tenant", static + tail))                      # new conversation
        else:
            queries.append(("other", static + tail))                       # another namespace
    return Stored(size, store, conv, queries, built)


def interleaved(stores: list[Stored], rounds: int,
                call: Callable[[Stored, int], Callable[[], Any]]) -> dict[int, float]:
    """Median seconds of ``call(stored, i)()`` per store, the stores taking turns within each
    round (the order rotating), so the machine's load falls on every size alike."""
    times: dict[int, list[float]] = {s.size: [] for s in stores}
    for i in range(rounds):
        shift = i % len(stores)
        for s in stores[shift:] + stores[:shift]:
            times[s.size].append(timed(call(s, i)))
    return {size: statistics.median(ts) for size, ts in times.items()}


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    stores = [build(int(size), args) for size in args.sizes.split(",")]
    for s in stores:   # the index answers as the scan did (the scan is slow at 100,000)
        for ns, ids in s.queries[:args.scan_queries]:
            got = s.store.longest_common_prefix(ns, MODEL, ids, len(ids) - 1)
            want = old_scan(s.store, ns, ids, len(ids) - 1)
            assert (got and got[0]) == (want and want[0]), "the index and the scan disagree"

    def lookup(s: Stored, i: int) -> Callable[[], Any]:
        ns, ids = s.queries[i % len(s.queries)]
        return lambda: s.store.longest_common_prefix(ns, MODEL, ids, len(ids) - 1)

    def scan(s: Stored, i: int) -> Callable[[], Any]:
        ns, ids = s.queries[i % len(s.queries)]
        return lambda: old_scan(s.store, ns, ids, len(ids) - 1)

    rng = random.Random(0)

    def put(s: Stored, i: int) -> Callable[[], Any]:
        ids = s.conv(rng.randrange(s.size)) + [rng.randrange(VOCAB) for _ in range(64)]
        return lambda: s.store.put("tenant", MODEL, ids, Blob(1), supersede=True)

    def supersede_scan(s: Stored, i: int) -> Callable[[], Any]:
        ids = s.conv(rng.randrange(s.size)) + [rng.randrange(VOCAB) for _ in range(64)]
        return lambda: old_supersede_scan(s.store, "tenant", ids)

    index_s = interleaved(stores, args.queries, lookup)
    scan_s = interleaved(stores, args.scan_queries, scan)
    put_s = interleaved(stores, args.queries, put)
    old_put_s = interleaved(stores, args.scan_queries, supersede_scan)
    return [{"entries": s.size, "build_s": s.build_s, "index_us": 1e6 * index_s[s.size],
             "scan_us": 1e6 * scan_s[s.size], "put_us": 1e6 * put_s[s.size],
             "old_supersede_scan_us": 1e6 * old_put_s[s.size]} for s in stores]


def table(rows: list[dict[str, Any]], command: str) -> str:
    base = rows[0]["index_us"]
    lines = ["| stored entries | lookup, index (us) | lookup, old scan (us) | scan / index | "
             "index vs 10 entries | put + supersede, index (us) | old supersede scan alone (us) |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['entries']:,} | {r['index_us']:.1f} | {r['scan_us']:,.1f} | "
                     f"{r['scan_us'] / r['index_us']:,.1f}x | {r['index_us'] / base:.2f}x | "
                     f"{r['put_us']:.1f} | {r['old_supersede_scan_us']:,.1f} |")
    from prefix_cache.testing.benchmark import cpu_name

    cpu = cpu_name()
    return ("\n".join(lines) + f"\n\nCommand: `{command}`. Machine: {cpu}, {os.cpu_count()} "
            f"cores, {platform.system()} {platform.release()}, Python "
            f"{platform.python_version()}; shared with other engineers' builds and tests while "
            "it ran (a loaded 2-core machine: ratios within one run, not absolute times, are "
            "the result).")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="10,1000,100000")
    ap.add_argument("--queries", type=int, default=300)
    ap.add_argument("--scan-queries", type=int, default=30,
                    help="how many queries also time the old scan (slow at 100,000 entries)")
    ap.add_argument("--static", type=int, default=512, help="tokens of the shared static prefix")
    ap.add_argument("--turns", type=int, default=256, help="tokens of each conversation's own")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--update-docs", action="store_true")
    args = ap.parse_args()
    command = "python bench/kv_lookup.py " + " ".join(sys.argv[1:])
    rows = run(args)
    text = table(rows, command.strip())
    print(text)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    if args.update_docs:
        doc = DOCS.read_text(encoding="utf-8")
        start, end = doc.index(MARK_START) + len(MARK_START), doc.index(MARK_END)
        DOCS.write_text(doc[:start] + "\n" + text + "\n" + doc[end:], encoding="utf-8")


if __name__ == "__main__":
    main()
