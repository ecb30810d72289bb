"""One tenant flooding the sidecar with large prompts, another asking for hits: the second
tenant's latency alone and during the flood, for this tree and a base tree, in one run.

    python bench/tenant_isolation.py [--base /tmp/old-main] [--flooders 4] [--body-mb 2]
                                     [--hits 40] [--env PREFIX_CACHE_TENANT_MAX_CONCURRENCY=2]

Per tree: `prefix-cache serve` (demo model, memory store, one worker, tenants "flood" and
"quiet") on loopback; tenant "quiet" sends ``--hits`` boundary requests one at a time (a warm
static prefix, a new user turn each: hits that render their prompt), first alone, then while
``--flooders`` clients of tenant "flood" each keep sending ``--body-mb`` MB prompts. Reported:
quiet's p50/p99 alone and under the flood, their ratio, and what the flood got (200, 429, 413).
The machine is shared: read the ratios, not the milliseconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from prefix_cache.testing.benchmark import SYSTEM_PROMPT, bench_tools, cpu_name  # noqa: E402

KEYS = {"sk-flood": "flood", "sk-quiet": "quiet"}


def start(tree: Path, port: int, env: dict[str, str], home: Path) -> subprocess.Popen[bytes]:
    environ = {**os.environ, "PYTHONPATH": str(tree), "PREFIX_CACHE_HOME": str(home),
               "PREFIX_CACHE_API_KEYS": json.dumps(KEYS), "HF_HUB_OFFLINE": "1",
               "TOKENIZERS_PARALLELISM": "false", "PREFIX_CACHE_LOG_LEVEL": "warning", **env}
    return subprocess.Popen([sys.executable, "-m", "prefix_cache.cli", "serve", "--port",
                             str(port)], cwd=tree, env=environ)


async def wait_ready(client: httpx.AsyncClient, url: str, deadline_s: float = 120.0) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        try:
            if (await client.get(f"{url}/healthz")).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        await asyncio.sleep(0.2)
    raise RuntimeError(f"{url} did not start")


def quiet_body(turn: int) -> bytes:
    return json.dumps({"messages": [{"role": "system", "content": SYSTEM_PROMPT},
                                    {"role": "user", "content": f"Question {turn}?"}],
                       "tools": bench_tools(16)}).encode()


def flood_body(mb: float) -> bytes:
    text = ("All work and no play makes a long prompt. " * int(mb * (1 << 20) / 43))
    return json.dumps({"messages": [{"role": "system", "content": f"Agent {uuid.uuid4().hex}."},
                                    {"role": "user", "content": text}]}).encode()


async def quiet_latencies(client: httpx.AsyncClient, url: str, n: int,
                          warm: bool = False) -> list[float]:
    headers = {"authorization": "Bearer sk-quiet", "content-type": "application/json"}
    out = []
    for turn in range(n):
        t0 = time.perf_counter()
        r = await client.post(f"{url}/v1/prefix/boundary", content=quiet_body(turn),
                              headers=headers)
        out.append(time.perf_counter() - t0)
        assert r.status_code == 200 and (warm or r.json()["cache"] == "hit"), r.text
    return out


async def flood(client: httpx.AsyncClient, url: str, mb: float, stop: asyncio.Event,
                statuses: list[int]) -> None:
    headers = {"authorization": "Bearer sk-flood", "content-type": "application/json"}
    while not stop.is_set():
        try:
            r = await client.post(f"{url}/v1/prefix/boundary", content=flood_body(mb),
                                  headers=headers)
            statuses.append(r.status_code)
            if r.status_code == 429:
                await asyncio.sleep(float(r.headers.get("retry-after", "1")))
        except httpx.HTTPError:
            statuses.append(0)


def pct(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))] * 1000


async def measure(tree: Path, args: argparse.Namespace, env: dict[str, str]) -> dict[str, object]:
    port = 18000 + os.getpid() % 1000 + (7 if tree == ROOT else 0)
    url = f"http://127.0.0.1:{port}"
    proc = start(tree, port, env, Path(args.home))
    try:
        limits = httpx.Limits(max_connections=args.flooders + 4)
        async with httpx.AsyncClient(trust_env=False, timeout=600, limits=limits) as client:
            await wait_ready(client, url)
            await quiet_latencies(client, url, 3, warm=True)         # the entry, the code
            alone = await quiet_latencies(client, url, args.hits)
            stop, statuses = asyncio.Event(), []
            flooders = [asyncio.create_task(flood(client, url, args.body_mb, stop, statuses))
                        for _ in range(args.flooders)]
            await asyncio.sleep(args.ramp_s)                         # the flood is under way
            during = await quiet_latencies(client, url, args.hits)
            stop.set()
            await asyncio.gather(*flooders)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    return {"alone_p50": pct(alone, 0.5), "alone_p99": pct(alone, 0.99),
            "flood_p50": pct(during, 0.5), "flood_p99": pct(during, 0.99),
            "flood_statuses": {s: statuses.count(s) for s in sorted(set(statuses))}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", help="a base tree to compare (e.g. git archive of main)")
    parser.add_argument("--flooders", type=int, default=4)
    parser.add_argument("--body-mb", type=float, default=2.0)
    parser.add_argument("--hits", type=int, default=40)
    parser.add_argument("--ramp-s", type=float, default=3.0)
    parser.add_argument("--home", default=str(Path.home() / ".cache" / "prefix-cache"))
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="a setting for this tree's sidecar (repeatable)")
    args = parser.parse_args()
    env = dict(item.split("=", 1) for item in args.env)
    trees = [("base", Path(args.base))] if args.base else []
    trees.append(("this tree", ROOT))
    print(f"machine: {cpu_name()}, {os.cpu_count()} cores (shared); flood: {args.flooders} x "
          f"{args.body_mb} MB prompts; quiet: {args.hits} hits one at a time; {env or ''}")
    print("| tree | quiet p50 alone | quiet p50 flood | p50 ratio | quiet p99 alone | "
          "quiet p99 flood | p99 ratio | flood answers |")
    print("|---|---|---|---|---|---|---|---|")
    for name, tree in trees:
        r = asyncio.run(measure(tree, args, env if tree == ROOT else {}))
        print(f"| {name} | {r['alone_p50']:.1f} ms | {r['flood_p50']:.1f} ms | "
              f"{r['flood_p50'] / r['alone_p50']:.1f}x | {r['alone_p99']:.1f} ms | "
              f"{r['flood_p99']:.1f} ms | {r['flood_p99'] / r['alone_p99']:.1f}x | "
              f"{r['flood_statuses']} |", flush=True)


if __name__ == "__main__":
    main()
