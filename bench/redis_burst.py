"""A burst of lookups against a fresh ``prefix-cache serve --redis``: hits out of N, on M starts.

    python bench/redis_burst.py [--requests 128] [--starts 10] [--answer-timeout S] [--compare]

A redis-server on a free port (loopback), N agents' entries stored in it once by a first sidecar,
then M times: a fresh ``serve --redis URL`` (nothing in its memory tier, no connection made by a
request yet), N concurrent ``POST /v1/prefix/boundary`` for those agents at once, the answers'
``x-prefix-cache`` counted, the server stopped. Every answer should be a hit: Redis is healthy,
and a burst of new connections to it is not an outage. The tenant's concurrency limit is raised
to N so the N lookups really reach Redis together (the default 2 per worker would queue them).

``--compare`` runs the same starts a second time as main did, side by side: connection set-up
under the 50 ms answer timeout (``PREFIX_CACHE_REDIS_CONNECT_TIMEOUT_S=0.05``) and no warm-up
(``PREFIX_CACHE_REDIS_WARM_CONNECTIONS=0``). Printed: hits at each start, the total, and how
the store failures the servers logged, by reason.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from load import free_port, wait_ready  # noqa: E402
from soak import start_redis  # noqa: E402

from prefix_cache.model_folders.demo import DEMO_NAME  # noqa: E402
from prefix_cache.testing.benchmark import SYSTEM_PROMPT, bench_tools  # noqa: E402

MAIN_LIKE = {"PREFIX_CACHE_REDIS_CONNECT_TIMEOUT_S": "0.05",
             "PREFIX_CACHE_REDIS_WARM_CONNECTIONS": "0"}


def body(agent: int) -> bytes:
    return json.dumps({
        "model": DEMO_NAME, "tools": bench_tools(1 + agent % 8),
        "messages": [{"role": "system", "content": f"{SYSTEM_PROMPT} You are agent {agent}."},
                     {"role": "user", "content": "Fix the failing test."}],
    }).encode()


class Sidecar:
    """One ``serve --redis`` process on a free port; its log kept for counting."""

    def __init__(self, redis_url: str, workdir: Path, env: dict[str, str]) -> None:
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log = tempfile.NamedTemporaryFile(dir=workdir, suffix=".log", delete=False)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "prefix_cache.cli", "serve", "--port", self.url.rsplit(":", 1)[1],
             "--redis", redis_url], cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT)

    def __enter__(self) -> Sidecar:
        wait_ready(f"{self.url}/healthz", timeout=600.0)
        return self

    def __exit__(self, *_: object) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()

    def failures(self) -> dict[str, int]:
        """The store failures it logged, by reason (ports and counts taken out)."""
        reasons: dict[str, int] = {}
        for line in Path(self.log.name).read_text(errors="replace").splitlines():
            if "computing instead: " in line:
                reason = re.sub(r"[0-9.]+:[0-9]+|[0-9]+", "N", line.split("computing instead: ")[1])
                reasons[reason] = reasons.get(reason, 0) + 1
        return reasons


async def burst(url: str, n: int) -> list[str]:
    """N boundary requests at once; each answer's ``x-prefix-cache`` (or the error)."""
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    async with httpx.AsyncClient(base_url=url, trust_env=False, timeout=120.0,
                                 limits=limits) as client:
        async def one(agent: int) -> str:
            r = await client.post("/v1/prefix/boundary", content=body(agent),
                                  headers={"content-type": "application/json"})
            return r.headers.get("x-prefix-cache", "") if r.status_code == 200 else \
                f"HTTP {r.status_code}"
        return await asyncio.gather(*(one(i) for i in range(n)))


def starts(args: argparse.Namespace, redis_url: str, workdir: Path,
           env: dict[str, str]) -> dict[str, object]:
    hits: list[int] = []
    failures: dict[str, int] = {}
    for _ in range(args.starts):
        with Sidecar(redis_url, workdir, env) as sidecar:
            answers = asyncio.run(burst(sidecar.url, args.requests))
        hits.append(answers.count("hit"))
        for reason, n in sidecar.failures().items():
            failures[reason] = failures.get(reason, 0) + n
    return {"hits_per_start": hits, "hits": sum(hits), "lookups": args.requests * args.starts,
            "store_failures_logged": failures}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=128, help="concurrent lookups per start")
    parser.add_argument("--starts", type=int, default=10, help="fresh sidecars, one burst each")
    parser.add_argument("--answer-timeout", type=float, metavar="S",
                        help="PREFIX_CACHE_REDIS_TIMEOUT_S for every start (default: the "
                        "service's 50 ms; a machine far busier than two cores can serve may "
                        "need more, connections or not)")
    parser.add_argument("--compare", action="store_true",
                        help="also run the starts as main did (50 ms set-up, no warm-up)")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="prefix-cache-burst-"))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
           "TOKENIZERS_PARALLELISM": "false", "PREFIX_CACHE_LOG_LEVEL": "warning",
           "PREFIX_CACHE_TENANT_MAX_CONCURRENCY": str(args.requests)}
    if args.answer_timeout:
        env["PREFIX_CACHE_REDIS_TIMEOUT_S"] = str(args.answer_timeout)
    redis, redis_url = start_redis(workdir)
    try:
        wait_redis(redis_url)
        with Sidecar(redis_url, workdir, env) as first:  # stores the N entries, one at a time
            with httpx.Client(base_url=first.url, trust_env=False, timeout=120.0) as client:
                for i in range(args.requests):
                    client.post("/v1/prefix/boundary", content=body(i),
                                headers={"content-type": "application/json"}).raise_for_status()
        out = {"requests": args.requests, "starts": args.starts,
               "answer_timeout_s": args.answer_timeout or 0.05,
               "now": starts(args, redis_url, workdir, env)}
        if args.compare:
            out["as_main"] = starts(args, redis_url, workdir, {**env, **MAIN_LIKE})
        out["load_average"] = round(os.getloadavg()[0], 2)
    finally:
        redis.terminate()
        redis.wait(timeout=30)
        shutil.rmtree(workdir, ignore_errors=True)
    print(json.dumps(out))
    now = out["now"]
    return 0 if now["hits"] == now["lookups"] else 1


def wait_redis(url: str, timeout: float = 10.0) -> None:
    import redis

    deadline = time.monotonic() + timeout
    while True:
        try:
            redis.Redis.from_url(url).ping()
            return
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


if __name__ == "__main__":
    sys.exit(main())
