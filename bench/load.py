"""Load benchmark of the sidecar (loopback only, bounded): requests/s and added latency over a
direct call to the same upstream, at 1, 16 and 64 concurrent clients, hit and miss mixes, for
16- and 64-tool agents; direct and sidecar alternate a slice of the requests at a time.

    python bench/load.py [--requests 200] [--rounds 4] [--output docs/benchmarks-load.table.md]

Three processes on this machine: a minimal OpenAI-compatible upstream (answers at once, so what
is measured is the sidecar), the sidecar (`prefix-cache serve --upstream ...`, demo model,
memory store, one worker), and this client. For each case the same request list is sent
straight to the upstream and through the sidecar, side by side in one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from prefix_cache.testing.benchmark import SYSTEM_PROMPT, bench_tools, cpu_name  # noqa: E402

UPSTREAM_APP = '''
import orjson
from starlette.applications import Starlette
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

BODY = orjson.dumps({"id": "chatcmpl-bench", "object": "chat.completion", "created": 0,
    "model": "bench", "choices": [{"index": 0, "finish_reason": "stop",
    "message": {"role": "assistant", "content": "ok"}}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})

CHUNKS = [b"data: " + orjson.dumps({"id": "chatcmpl-bench", "object": "chat.completion.chunk",
    "created": 0, "model": "bench", "choices": [{"index": 0, "delta": {"content": text},
    "finish_reason": None}]}) + b"\\n\\n" for text in ("o", "k", "!")] + [b"data: [DONE]\\n\\n"]

async def chunks():
    for chunk in CHUNKS:
        yield chunk

async def chat(request):
    raw = await request.body()
    if b'"stream": true' in raw or b'"stream":true' in raw:
        return StreamingResponse(chunks(), media_type="text/event-stream")
    return Response(BODY, media_type="application/json")

async def health(request):
    return Response(b"{}", media_type="application/json")

app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]),
                        Route("/health", health)])
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_ready(url: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1.0, trust_env=False).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} did not become ready")


def bodies(n: int, tools: int, mix: str) -> list[bytes]:
    """n chat bodies of one agent: "hit" shares one system prompt, "miss" makes each unique."""
    tool_list = bench_tools(tools)
    out = []
    for i in range(n):
        system = SYSTEM_PROMPT if mix == "hit" else f"{SYSTEM_PROMPT} Session {uuid.uuid4().hex}."
        out.append(json.dumps({
            "model": "demo-qwen3", "max_tokens": 1, "tools": tool_list,
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": f"Request {i}: fix module_{i}.py"}],
        }).encode())
    return out


async def run(url: str, payloads: list[bytes], concurrency: int) -> tuple[list[float], float]:
    """Send all payloads with ``concurrency`` clients; per-request seconds and the wall time."""
    latencies: list[float] = []
    queue: asyncio.Queue[bytes] = asyncio.Queue()
    for p in payloads:
        queue.put_nowait(p)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(trust_env=False, timeout=120.0, limits=limits) as client:
        async def worker() -> None:
            while not queue.empty():
                body = queue.get_nowait()
                start = time.perf_counter()
                r = await client.post(url, content=body, headers={"content-type": "application/json"})
                latencies.append(time.perf_counter() - start)
                if r.status_code != 200:
                    raise RuntimeError(f"{url}: HTTP {r.status_code}: {r.text[:200]}")
        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - started
    return latencies, wall


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200, help="requests per case")
    parser.add_argument("--rounds", type=int, default=4,
                        help="slices of each case's requests, direct and sidecar alternating")
    parser.add_argument("--output", help="write the markdown table here")
    args = parser.parse_args()

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    up_port, side_port = free_port(), free_port()
    workdir = Path(os.environ.get("TMPDIR", "/tmp")) / f"prefix-cache-load-{os.getpid()}"
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "upstream_app.py").write_text(UPSTREAM_APP)
    procs = [
        subprocess.Popen([sys.executable, "-m", "uvicorn", "upstream_app:app", "--port", str(up_port),
                          "--log-level", "warning", "--no-access-log"], cwd=workdir, env=env),
        subprocess.Popen([sys.executable, "-m", "prefix_cache.cli", "serve", "--port", str(side_port),
                          "--upstream", f"http://127.0.0.1:{up_port}/v1"],
                         env={**env, "PREFIX_CACHE_LOG_LEVEL": "warning"}, cwd=ROOT),
    ]
    rows = []
    try:
        wait_ready(f"http://127.0.0.1:{up_port}/health")
        wait_ready(f"http://127.0.0.1:{side_port}/healthz")
        direct = f"http://127.0.0.1:{up_port}/v1/chat/completions"
        sidecar = f"http://127.0.0.1:{side_port}/v1/chat/completions"
        # Warm both (tokenizer fingerprint, template compile, connections).
        asyncio.run(run(sidecar, bodies(4, 16, "hit"), 1))
        for tools in (16, 64):
            for mix in ("hit", "miss"):
                for conc in (1, 16, 64):
                    payloads = bodies(args.requests, tools, mix)
                    # Direct and sidecar alternate, a slice of the requests at a time, so noise
                    # from a shared machine falls on both alike.
                    # A slice holds at least ``conc`` requests, so the concurrency is real.
                    d_lat, s_lat, d_wall, s_wall = [], [], 0.0, 0.0
                    rounds = max(1, min(args.rounds, len(payloads) // conc))
                    step = -(-len(payloads) // rounds)
                    for start in range(0, len(payloads), step):
                        part = payloads[start:start + step]
                        lat, wall = asyncio.run(run(direct, part, conc))
                        d_lat, d_wall = d_lat + lat, d_wall + wall
                        lat, wall = asyncio.run(run(sidecar, part, conc))
                        s_lat, s_wall = s_lat + lat, s_wall + wall
                    row = {
                        "tools": tools, "mix": mix, "clients": conc,
                        "direct_rps": len(payloads) / d_wall, "sidecar_rps": len(payloads) / s_wall,
                        "direct_p50": statistics.median(d_lat), "sidecar_p50": statistics.median(s_lat),
                        "direct_p99": pct(d_lat, 0.99), "sidecar_p99": pct(s_lat, 0.99),
                    }
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=30)

    cpu = cpu_name()
    lines = [
        f"Machine: {cpu}, {os.cpu_count()} cores (client, sidecar and upstream share them). "
        f"{args.requests} requests per row; the sidecar renders each prompt (no prompt ids from "
        f"the client), demo model (real Qwen3 tokenizer), memory store, one worker; direct and "
        f"sidecar alternate in up to {args.rounds} slices per row (of at least as many "
        f"requests as clients). "
        f"Command: `python bench/load.py --requests {args.requests} --rounds {args.rounds}`",
        "",
        "| tools | mix | clients | direct req/s | sidecar req/s | direct p50 | sidecar p50 | added p50 | direct p99 | sidecar p99 | added p99 |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    ms = lambda s: f"{s * 1e3:.1f} ms"  # noqa: E731
    for r in rows:
        lines.append(
            f"| {r['tools']} | {r['mix']} | {r['clients']} | {r['direct_rps']:.0f} | {r['sidecar_rps']:.0f} | "
            f"{ms(r['direct_p50'])} | {ms(r['sidecar_p50'])} | {ms(r['sidecar_p50'] - r['direct_p50'])} | "
            f"{ms(r['direct_p99'])} | {ms(r['sidecar_p99'])} | {ms(r['sidecar_p99'] - r['direct_p99'])} |")
    table = "\n".join(lines) + "\n"
    print(table)
    if args.output:
        Path(args.output).write_text(table, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
