"""Engine stats as an engine reports them (every counter and both KV tiers set), and an engine
that only reports stats: what the metrics layer reads at scrape time."""

from __future__ import annotations

from prefix_cache.engine.protocol import DiskKVStats, EngineStats, KVStoreStats

ENGINE_STATS = EngineStats(
    requests=5, completed=4, cancelled=1, failed=0, specprefill=2, fallbacks=1,
    reused_tokens=900, prefilled_tokens=120, generated_tokens=40, parked=0,
    conversation_hits=3, last_fallback="x", active=1,
    kv_store=KVStoreStats(hits=4, misses=1, puts=1, evictions=0, rejected=2,
                          superseded=0, by_namespace={"t": 1}, entries=1, bytes=4096,
                          max_bytes=1 << 30),
    kv_disk=DiskKVStats(hits=3, misses=2, writes=4, write_drops=1, write_errors=0,
                        evictions=1, discarded=1, loads=3, load_seconds=0.25, entries=3,
                        bytes=12288, max_bytes=1 << 34),
)


class StatsEngine:
    """An engine that only reports ``stats``; with None, as one that is gone."""

    def __init__(self, stats: EngineStats | None) -> None:
        self.stats = stats

    def snapshot_stats(self) -> EngineStats:
        if self.stats is None:
            raise RuntimeError("engine gone")
        return self.stats
