"""What a relayed hit adds to each agent client's real first request: Claude Code's, Codex's and
opencode's recorded first tool-loop request (tests/agent_clients/fixtures/), sent straight to
a scripted upstream and through the sidecar in front of it (a static-prefix hit after one
warm-up), alternating, side by side in one run.

    PYTHONPATH=$PWD python bench/agent_clients_hit.py [--reps 40] [--update-docs]

The upstream (``tests.support.tool_loop_upstream``, uvicorn, its own process) answers each API
natively and streams a tool call; the sidecar (``prefix-cache serve --model DIR --upstream URL``,
its own process, the Qwen3 tokenizer with the demo template) relays chat completions and
converts Messages and Responses to chat and back. Each client's request goes as recorded (its
stream included) on one keep-alive connection per target; the time is request out to the last
byte in. Reported: medians, the added time (relayed - direct) and the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.engine import update_docs  # noqa: E402
from bench.servers import start_server  # noqa: E402

FIXTURES = ROOT / "tests" / "agent_clients" / "fixtures"
CLIENTS = {"Claude Code": ("claude_code", "/v1/messages?beta=true"),
           "Codex": ("codex", "/v1/responses"),
           "opencode": ("opencode", "/v1/chat/completions")}
DOCS = ROOT / "docs" / "benchmarks.md"
MARK = "<!-- agent-clients-hit -->"


def first_loop_request(fixture: str) -> dict[str, Any]:
    for line in (FIXTURES / f"{fixture}.jsonl").read_text().splitlines():
        request = json.loads(line)
        if request["body"].get("tools"):
            return request
    raise ValueError(f"{fixture}: no request with tools")


def timed(client: httpx.Client, url: str, body: bytes, headers: dict[str, str]
          ) -> tuple[float, str | None]:
    start = time.perf_counter()
    with client.stream("POST", url, content=body, headers=headers) as response:
        for _ in response.iter_raw():
            pass
    elapsed = time.perf_counter() - start
    if response.status_code != 200:
        raise RuntimeError(f"{url} answered {response.status_code}")
    return elapsed, response.headers.get("x-prefix-cache")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=40)
    parser.add_argument("--update-docs", action="store_true")
    args = parser.parse_args()
    from prefix_cache.model_folders.demo import DEMO_TEMPLATE
    from prefix_cache.testing.offline_tokenizers import make_model_dir

    tmp = Path(tempfile.mkdtemp(prefix="agent-clients-hit-"))
    model_dir = make_model_dir(tmp / "local-model", "qwen3", DEMO_TEMPLATE)
    env = {"PYTHONPATH": str(ROOT), "PREFIX_CACHE_HOME": str(tmp)}
    upstream = start_server("upstream", [sys.executable, "-m", "tests.support.tool_loop_upstream"],
                            tmp / "upstream.log", env)
    sidecar = start_server("sidecar", [sys.executable, "-m", "prefix_cache.cli", "serve",
                                       "--model", str(model_dir), "--upstream", upstream.url,
                                       "--host", "127.0.0.1"], tmp / "sidecar.log", env)
    rows = ["| client (its first request) | body | direct to the upstream (median) "
            "| through the sidecar, a hit (median) | added | ratio |",
            "|---|---:|---:|---:|---:|---:|"]
    try:
        with httpx.Client(timeout=60.0, trust_env=False) as direct, \
                httpx.Client(timeout=60.0, trust_env=False) as relayed:
            for name, (fixture, path) in CLIENTS.items():
                request = first_loop_request(fixture)
                body = json.dumps({**request["body"], "model": sidecar.model}).encode()
                headers = {"content-type": "application/json",
                           "authorization": "Bearer sk-bench", "x-api-key": "sk-bench"}
                _, first = timed(relayed, sidecar.url + path, body, headers)
                _, second = timed(relayed, sidecar.url + path, body, headers)
                assert (first, second) == ("miss", "hit"), (name, first, second)
                timed(direct, upstream.url + path, body, headers)
                ours, theirs = [], []
                for _ in range(args.reps):
                    theirs.append(timed(direct, upstream.url + path, body, headers)[0])
                    t, cache = timed(relayed, sidecar.url + path, body, headers)
                    assert cache == "hit", (name, cache)
                    ours.append(t)
                d, r = statistics.median(theirs) * 1e3, statistics.median(ours) * 1e3
                rows.append(f"| {name} | {len(body) / 1024:.0f} KB | {d:.2f} ms | {r:.2f} ms "
                            f"| {r - d:.2f} ms | {r / d:.2f}x |")
    finally:
        sidecar.stop()
        upstream.stop()
    load = os.getloadavg()
    text = "\n".join(rows) + (f"\n\n(load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} "
                              f"at the end; {args.reps} alternating repeats)")
    print(text)
    if args.update_docs:
        update_docs(text, MARK, MARK, DOCS)


if __name__ == "__main__":
    main()
