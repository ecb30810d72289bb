"""Soak test of the sidecar (loopback only, bounded: it stops by itself after --duration).

    python bench/soak.py [--duration 600] [--clients 8] [--tenants 4] [--agents 200]
                         [--hit-rate 0.85] [--workers 2] [--redis auto|none|URL]
                         [--output docs/reliability-soak.table.md] [--json]

Processes on this machine: a minimal OpenAI-compatible upstream (answers at once, plain and
streamed, so what is measured is the sidecar), a redis-server on a free port (``--redis auto``,
when installed), ``prefix-cache serve --workers N --redis URL --upstream ...`` with one API key
per tenant, and this client. Many agents (a system prompt and 1-16 tools each, spread over the
tenants) send chat completions, a quarter of them streamed; a share of the requests comes from
agents never seen before, so the hit rate settles near ``--hit-rate``. Every request is sent
both straight to the upstream and through the sidecar, in a random order, so the added latency
is measured side by side on the same machine at the same moment.

Reported: requests, errors (any non-200 or transport error: the target is 0), boundary
mismatches (a later answer for the same agent and turn that differs from the first: 0), hit
rate, p50/p99 of the upstream alone, of the sidecar and their difference, and the RSS of the
sidecar's processes after the warm-up and at the end (and the highest seen), and at each tenth
of the run (sampled every few seconds): whether it levels off.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from load import UPSTREAM_APP, free_port, pct, wait_ready  # noqa: E402

from prefix_cache.model_folders.demo import DEMO_NAME  # noqa: E402
from prefix_cache.testing.benchmark import SYSTEM_PROMPT, bench_tools, cpu_name  # noqa: E402

RSS_SAMPLE_S = 5.0
STREAM_SHARE = 0.25
ADMIN_KEY = "sk-soak-admin"
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}
HARD_STOP_EXTRA_S = 120.0  # the whole run ends by then, whatever happens


@dataclass
class Stats:
    direct: list[float] = field(default_factory=list)
    sidecar: list[float] = field(default_factory=list)
    hits: int = 0
    misses: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    mismatches: int = 0
    boundaries: dict[tuple[str, int], int] = field(default_factory=dict)

    def error(self, what: str) -> None:
        self.errors[what] = self.errors.get(what, 0) + 1


def rss_bytes(pid: int) -> int:
    """Resident memory of ``pid`` and all its descendants."""
    return sum(rss_by_process(pid).values())


def rss_by_process(pid: int) -> dict[int, int]:
    """Resident memory of ``pid`` and of each of its descendants, by pid."""
    found: dict[int, int] = {}
    pending = [pid]
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    while pending:
        p = pending.pop()
        pending.extend(parents.get(p, []))
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    found[p] = int(line.split()[1]) * 1024
        except OSError:
            continue
    return found


class Agents:
    """The population: agents seen before (their requests can hit) and new ones arriving (their
    first request is a miss). ``warming`` agents are sent once each before measuring."""

    def __init__(self, tenants: list[str], initial: int, hit_rate: float, seed: int = 7) -> None:
        self.tenants = tenants
        self.hit_rate = hit_rate
        self.rng = random.Random(seed)
        self.known: list[tuple[str, str, int]] = []   # (agent id, tenant key, tools), seen
        self.warming = [self._make(i) for i in range(initial)]

    def _make(self, n: int) -> tuple[str, str, int]:
        return (f"agent-{n}-{self.rng.getrandbits(32):08x}", self.tenants[n % len(self.tenants)],
                1 + n % 16)

    def pick(self) -> tuple[str, str, int]:
        if self.warming:
            agent = self.warming.pop()
        elif self.known and self.rng.random() < self.hit_rate:
            return self.rng.choice(self.known)
        else:
            agent = self._make(len(self.known))
        self.known.append(agent)
        return agent


def body(agent: str, tools: int, turn: int, stream: bool) -> bytes:
    return json.dumps({
        "model": DEMO_NAME, "max_tokens": 8, "stream": stream, "tools": bench_tools(tools),
        "messages": [{"role": "system", "content": f"{SYSTEM_PROMPT} You are {agent}."},
                     {"role": "user", "content": f"Turn {turn}: fix module_{turn}.py"}],
    }).encode()


async def client_loop(stop_at: float, agents: Agents, stats: Stats, sidecar: httpx.AsyncClient,
                      direct: httpx.AsyncClient, rng: random.Random, measure: bool) -> None:
    while time.monotonic() < stop_at and (measure or agents.warming):
        agent, key, tools = agents.pick()
        turn = rng.randrange(3)
        stream = rng.random() < STREAM_SHARE
        payload = body(agent, tools, turn, stream)
        order = ("direct", "sidecar") if rng.random() < 0.5 else ("sidecar", "direct")
        for target in order:
            client = direct if target == "direct" else sidecar
            headers = {"content-type": "application/json", "authorization": f"Bearer {key}"}
            started = time.perf_counter()
            try:
                async with client.stream("POST", "/v1/chat/completions", content=payload,
                                         headers=headers) as r:
                    content = await r.aread()
            except httpx.HTTPError as exc:
                stats.error(f"{target}: {type(exc).__name__}")
                continue
            elapsed = time.perf_counter() - started
            if r.status_code != 200 or (stream and not content.rstrip().endswith(b"[DONE]")):
                stats.error(f"{target}: HTTP {r.status_code} {content[:120]!r}")
                continue
            if target == "direct":
                if measure:
                    stats.direct.append(elapsed)
                continue
            if measure:
                stats.sidecar.append(elapsed)
                if r.headers.get("x-prefix-cache") == "hit":
                    stats.hits += 1
                else:
                    stats.misses += 1
            end = int(r.headers["x-specprefill-system-end"])
            first = stats.boundaries.setdefault((agent, turn), end)
            if first != end:
                stats.mismatches += 1


async def drive(args: argparse.Namespace, side_url: str, up_url: str, tenants: list[str],
                serve_pid: int) -> tuple[Stats, dict[str, Any]]:
    agents = Agents(tenants, args.agents, args.hit_rate)
    stats = Stats()
    limits = httpx.Limits(max_connections=args.clients, max_keepalive_connections=args.clients)
    async with httpx.AsyncClient(base_url=side_url, trust_env=False, timeout=60.0,
                                 limits=limits) as sidecar, \
            httpx.AsyncClient(base_url=up_url, trust_env=False, timeout=60.0, limits=limits) as direct:
        # Warm-up, not measured: every initial agent once (a miss each), bounded in time.
        warm = Stats()
        warm_until = time.monotonic() + args.duration
        rngs = [random.Random(1000 + i) for i in range(args.clients)]
        await asyncio.gather(*(client_loop(warm_until, agents, warm, sidecar, direct, rngs[i], False)
                               for i in range(args.clients)))
        stats.boundaries = warm.boundaries
        stats.mismatches = warm.mismatches
        stats.errors = dict(warm.errors)
        rss = {"start": rss_bytes(serve_pid)}
        rss["max"] = rss["start"]
        stop_at = time.monotonic() + args.duration

        trace: list[tuple[float, int]] = [(0.0, rss["start"])]
        tier: list[tuple[float, int, int]] = []  # (s, entries, bytes) of the memory tiers

        async def sample_rss() -> None:
            while time.monotonic() < stop_at:
                await asyncio.sleep(min(RSS_SAMPLE_S, max(0.0, stop_at - time.monotonic())))
                trace.append((time.monotonic() - started, rss_bytes(serve_pid)))
                rss["max"] = max(rss["max"], trace[-1][1])
                try:
                    scrape = await sidecar.get("/metrics", headers=ADMIN)
                except httpx.HTTPError:
                    continue
                if scrape.status_code == 200:
                    tier.append((trace[-1][0], *memory_tier(scrape.text)))

        started = time.monotonic()
        await asyncio.gather(sample_rss(), *(client_loop(stop_at, agents, stats, sidecar, direct,
                                                         rngs[i], True)
                                             for i in range(args.clients)))
        by_pid = rss_by_process(serve_pid)
        rss["end"] = sum(by_pid.values())
        rss["end_parent"] = by_pid.pop(serve_pid, 0)
        rss["end_workers"] = sorted(by_pid.values())
        scrape = await sidecar.get("/metrics", headers=ADMIN)
        rss["store_errors"] = (  # every worker's, summed; None if the scrape is refused
            int(sum(float(line.rsplit(" ", 1)[1]) for line in scrape.text.splitlines()
                    if line.startswith("prefix_cache_store_errors_total{")))
            if scrape.status_code == 200 else None)
        rss["max"] = max(rss["max"], rss["end"])
        rss["wall_s"] = time.monotonic() - started
        rss["agents"] = len(agents.known)
        rss["trace"] = [*trace, (rss["wall_s"], rss["end"])]
        rss["tier"] = tier
    return stats, rss


def memory_tier(metrics_text: str) -> tuple[int, int]:
    """Entries and bytes in the workers' in-process memory tiers (summed), from /metrics."""
    found = {"entries": 0, "bytes": 0}
    for line in metrics_text.splitlines():
        for what in found:
            if line.startswith(f'prefix_cache_store_{what}{{store="memory"}}'):
                found[what] = int(float(line.rsplit(" ", 1)[1]))
    return found["entries"], found["bytes"]


def slope_mb_per_min(trace: list[tuple[float, int]], since_s: float) -> float | None:
    """Least-squares slope of the samples taken from ``since_s`` on, in MB a minute."""
    points = [(t / 60, b / 2**20) for t, b in trace if t >= since_s]
    if len(points) < 2:
        return None
    mx = sum(x for x, _ in points) / len(points)
    my = sum(y for _, y in points) / len(points)
    var = sum((x - mx) ** 2 for x, _ in points)
    return round(sum((x - mx) * (y - my) for x, y in points) / var, 2) if var else None


def plot(path: Path, s: dict[str, Any], trace: list[tuple[float, int]],
         tier: list[tuple[float, int, int]]) -> None:
    """The sidecar's RSS (and the memory tiers' own bytes) over the run, as PNG or SVG."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.2), dpi=110)
    ax.plot([t / 60 for t, _ in trace], [b / 2**20 for _, b in trace],
            label=f"RSS, parent and {s['workers']} workers")
    if tier:
        ax.plot([t / 60 for t, _, _ in tier], [b / 2**20 for _, _, b in tier],
                label="memory tiers' entries (bytes they count)")
    half = s["duration_s"] / 120
    ax.axvline(half, color="grey", linestyle=":", linewidth=1)
    slope = s["rss_slope_last_half_mb_per_min"]
    ax.set_title(f"Soak: {s['requests']:,} requests in {s['duration_s'] / 60:.0f} min; RSS over "
                 f"the last half {slope:+.2f} MB/min", fontsize=10)
    ax.set_xlabel("minutes (after the warm-up)")
    ax.set_ylabel("MB")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="center right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def by_tenths(trace: list[tuple[float, int]], wall_s: float, unit: int = 2**20) -> list[float]:
    """A sampled value (bytes, as MB by default) at the start and at the end of each tenth of
    the run (the sample nearest it); [] without samples."""
    if not trace:
        return []
    marks = [wall_s * k / 10 for k in range(11)]
    return [round(min(trace, key=lambda t: abs(t[0] - m))[1] / unit, 1) for m in marks]


def start_redis(workdir: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    proc = subprocess.Popen([shutil.which("redis-server") or "redis-server", "--port", str(port),
                             "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(workdir)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc, f"redis://127.0.0.1:{port}/0"


def summarize(args: argparse.Namespace, stats: Stats, rss: dict[str, Any], redis_url: str | None,
              load: tuple[float, float]) -> dict[str, Any]:
    looked = stats.hits + stats.misses
    out: dict[str, Any] = {
        "duration_s": round(rss["wall_s"], 1), "clients": args.clients, "workers": args.workers,
        "tenants": args.tenants, "agents_seen": rss["agents"],
        "store": "redis" if redis_url else "memory",
        "requests": len(stats.sidecar), "requests_per_s": round(len(stats.sidecar) / rss["wall_s"], 1),
        "errors": sum(stats.errors.values()), "error_kinds": stats.errors,
        "boundary_mismatches": stats.mismatches,
        "store_errors": rss["store_errors"],  # lookups and writes that had to do without Redis
        "hit_rate": round(stats.hits / looked, 3) if looked else 0.0,
        "rss_start_mb": round(rss["start"] / 2**20, 1), "rss_end_mb": round(rss["end"] / 2**20, 1),
        "rss_max_mb": round(rss["max"] / 2**20, 1),
        "rss_end_parent_mb": round(rss["end_parent"] / 2**20, 1),
        "rss_end_workers_mb": [round(b / 2**20, 1) for b in rss["end_workers"]],
        "rss_by_tenth_mb": by_tenths(rss["trace"], rss["wall_s"]),
        "rss_slope_last_half_mb_per_min": slope_mb_per_min(rss["trace"], rss["wall_s"] / 2),
        "memory_tier_by_tenth_mb": by_tenths([(t, b) for t, _, b in rss["tier"]], rss["wall_s"]),
        "memory_tier_entries_by_tenth": by_tenths([(t, n) for t, n, _ in rss["tier"]],
                                                  rss["wall_s"], unit=1),
        "load_average_start_end": [round(load[0], 2), round(load[1], 2)],
        "machine": f"{cpu_name()}, {os.cpu_count()} cores",
    }
    for name, values in (("direct", stats.direct), ("sidecar", stats.sidecar)):
        for q in (0.5, 0.99):
            out[f"{name}_p{int(q * 100)}_ms"] = round(pct(values, q) * 1e3, 2) if values else None
    for q in ("p50", "p99"):
        if out[f"sidecar_{q}_ms"] is not None and out[f"direct_{q}_ms"] is not None:
            out[f"added_{q}_ms"] = round(out[f"sidecar_{q}_ms"] - out[f"direct_{q}_ms"], 2)
    return out


def table(args: argparse.Namespace, s: dict[str, Any]) -> str:
    command = (f"python bench/soak.py --duration {args.duration:g} --clients {args.clients} "
               f"--tenants {args.tenants} --agents {args.agents} --hit-rate {args.hit_rate} "
               f"--workers {args.workers} --redis {args.redis}")
    return "\n".join([
        f"Machine: {s['machine']} (load average {s['load_average_start_end'][0]} at the start, "
        f"{s['load_average_start_end'][1]} at the end, the soak's own processes included); "
        f"client, upstream, Redis and "
        f"sidecar on the same cores. Command: `{command}`",
        "",
        "| duration | requests | req/s | errors | boundary mismatches | hit rate | store errors | agents | "
        "direct p50 | sidecar p50 | added p50 | direct p99 | sidecar p99 | added p99 | "
        "RSS start | RSS end | RSS max |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        f"| {s['duration_s']} s | {s['requests']} | {s['requests_per_s']} | {s['errors']} | "
        f"{s['boundary_mismatches']} | {s['hit_rate']:.1%} | {s['store_errors']} | {s['agents_seen']} | "
        f"{s['direct_p50_ms']} ms | {s['sidecar_p50_ms']} ms | {s.get('added_p50_ms')} ms | "
        f"{s['direct_p99_ms']} ms | {s['sidecar_p99_ms']} ms | {s.get('added_p99_ms')} ms | "
        f"{s['rss_start_mb']} MB | {s['rss_end_mb']} MB | {s['rss_max_mb']} MB |",
        "",
        "RSS of the sidecar's processes at the start and after each tenth of the run (MB): "
        + ", ".join(f"{mb:g}" for mb in s["rss_by_tenth_mb"]) + f"; over the last half "
        f"{s['rss_slope_last_half_mb_per_min']} MB a minute (least squares over the 5 s samples). "
        "Bytes the workers' memory tiers count, at the same marks (MB): "
        + ", ".join(f"{mb:g}" for mb in s["memory_tier_by_tenth_mb"]) + ". At the end: the "
        f"parent {s['rss_end_parent_mb']} MB; its other processes (the workers and "
        "multiprocessing's helper) "
        + ", ".join(f"{mb:g}" for mb in s["rss_end_workers_mb"]) + " MB.",
        "",
    ])


def diagnostics(args: argparse.Namespace) -> dict[str, str]:
    """The sidecar's extra environment for ``--trace-heap`` and ``--malloc-arena-max``."""
    extra = {}
    if args.trace_heap:
        extra["SOAK_HEAP_DIR"] = str(args.trace_heap.resolve())
        extra["PYTHONPATH"] = os.pathsep.join(
            [str(ROOT / "bench" / "heapdiag"), str(ROOT), os.environ.get("PYTHONPATH", "")])
    if args.malloc_arena_max:
        extra["MALLOC_ARENA_MAX"] = str(args.malloc_arena_max)
    return extra


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=600.0, help="measured seconds")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--tenants", type=int, default=4)
    parser.add_argument("--agents", type=int, default=200,
                        help="agents sent once each before measuring (more arrive during the run)")
    parser.add_argument("--hit-rate", type=float, default=0.85,
                        help="share of requests from known agents")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--redis", default="auto", help="auto (start one if installed), none, or a URL")
    parser.add_argument("--redis-timeout", type=float, default=None,
                        help="the sidecar's Redis timeout in seconds (default: its own)")
    parser.add_argument("--output", help="write the markdown table here")
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON line")
    parser.add_argument("--trace-heap", type=Path, metavar="DIR",
                        help="trace the sidecar's Python heap (tracemalloc): each process writes "
                        "its top allocation sites every minute to DIR/<pid>.jsonl "
                        "(bench/heapdiag; slower, for diagnosis only)")
    parser.add_argument("--malloc-arena-max", type=int, metavar="N",
                        help="MALLOC_ARENA_MAX for the sidecar (glibc's arenas per process)")
    parser.add_argument("--plot", type=Path, help="draw RSS over time here (.png or .svg; needs "
                        "matplotlib, the bench extra)")
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="prefix-cache-soak-"))
    procs: list[subprocess.Popen[bytes]] = []
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    # A hard stop: whatever hangs, the run ends (and takes its processes with it).
    signal.signal(signal.SIGALRM, lambda *_: (_ for _ in ()).throw(TimeoutError("soak overran")))
    signal.alarm(int(2 * args.duration + HARD_STOP_EXTRA_S))
    try:
        redis_url = None
        if args.redis == "auto" and shutil.which("redis-server"):
            redis_proc, redis_url = start_redis(workdir)
            procs.append(redis_proc)
        elif args.redis not in ("auto", "none"):
            redis_url = args.redis
        tenants = [f"sk-soak-{i}" for i in range(args.tenants)]
        keys = workdir / "keys.json"
        keys.write_text(json.dumps({"tenants": {k: f"tenant{i}" for i, k in enumerate(tenants)},
                                    "admin_keys": [ADMIN_KEY]}))
        (workdir / "upstream_app.py").write_text(UPSTREAM_APP)
        up_port, side_port = free_port(), free_port()
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "upstream_app:app", "--port", str(up_port),
             "--log-level", "warning", "--no-access-log"], cwd=workdir, env=env))
        serve = [sys.executable, "-m", "prefix_cache.cli", "serve", "--port", str(side_port),
                 "--workers", str(args.workers), "--upstream", f"http://127.0.0.1:{up_port}/v1"]
        if redis_url:
            serve += ["--redis", redis_url]
        sidecar = subprocess.Popen(serve, cwd=ROOT, env={
            **env, **diagnostics(args), "PREFIX_CACHE_LOG_LEVEL": "warning",
            "PREFIX_CACHE_KEYS_FILE": str(keys),
            "PROMETHEUS_MULTIPROC_DIR": str(workdir / "metrics"),
            **({"PREFIX_CACHE_REDIS_TIMEOUT_S": str(args.redis_timeout)} if args.redis_timeout else {})})
        procs.append(sidecar)
        up_url, side_url = f"http://127.0.0.1:{up_port}", f"http://127.0.0.1:{side_port}"
        wait_ready(f"{up_url}/health")
        wait_ready(f"{side_url}/healthz", timeout=600.0)  # slow to start on a loaded machine
        load_start = os.getloadavg()[0]
        stats, rss = asyncio.run(drive(args, side_url, up_url, tenants, sidecar.pid))
        summary = summarize(args, stats, rss, redis_url, (load_start, os.getloadavg()[0]))
        if args.plot:
            plot(args.plot, summary, rss["trace"], rss["tier"])
    finally:
        signal.alarm(0)
        for p in reversed(procs):
            p.terminate()
        for p in reversed(procs):
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(workdir, ignore_errors=True)
    if args.json:
        print(json.dumps(summary), flush=True)
    else:
        print(table(args, summary))
    if args.output:
        Path(args.output).write_text(table(args, summary), encoding="utf-8")
    return 0 if summary["errors"] == 0 and summary["boundary_mismatches"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
