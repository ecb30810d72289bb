"""Where a boundary hit's time goes, step by step, in process (no sockets, no HTTP server).

The sidecar app (demo model, memory store, `tokenize_check_rate=0`) is driven through ASGI:
`GET /healthz` and a 64-tool `POST /v1/prefix/boundary` hit, alternately, then the hits again
with the steps named below timed around each call (wrappers add ~0.3 µs a step). Times are
means per request, so nested steps add up inside their parent, not across.

    PYTHONPATH=$PWD python bench/hit_steps.py [--requests 3000] [--turns N]

To see another commit's steps, copy this file into that commit's tree (``git archive``) and
run it there: steps it does not have are left out.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # as `serve` sets it

from prefix_cache.cache import cache as cache_module  # noqa: E402
from prefix_cache.cache import keys, _plan as plan  # noqa: E402
from prefix_cache.render import render  # noqa: E402

try:  # the accelerators: behind the fastpath seam in this tree, at the root in older ones
    from prefix_cache.fastpath import _direct_render as direct_render
    from prefix_cache.fastpath import _tail_pieces as tail_pieces
except ImportError:  # pragma: no cover
    from prefix_cache import direct_render  # type: ignore[no-redef]
    try:
        from prefix_cache import tail_pieces  # type: ignore[no-redef]
    except ImportError:
        tail_pieces = None  # type: ignore[assignment]
from prefix_cache.api import schemas  # noqa: E402
from prefix_cache.http import body as http_body  # noqa: E402
from prefix_cache.service import boundary_route, sidecar_host  # noqa: E402
from prefix_cache.service.app import create_app  # noqa: E402
from prefix_cache.service.server import make_settings  # noqa: E402
from prefix_cache.testing.benchmark import SYSTEM_PROMPT, bench_tools, machine  # noqa: E402

TOOLS = 64
StaticPrefixCache = cache_module.StaticPrefixCache
# (owner, attribute): the steps timed, outermost first.
STEPS = [
    (sidecar_host.SidecarHost, "read_body"), (http_body, "parse_body"),
    (schemas.BoundaryRequest, "model_validate"), (boundary_route, "boundary_fields"),
    (sidecar_host.SidecarHost, "resolve"),
    (StaticPrefixCache, "_plan"), (plan, "get_renderer"), (render.Renderers, "get"),
    (keys, "key_material"),
    (keys, "canonical_bytes"), (StaticPrefixCache, "_aget"), (StaticPrefixCache, "_read"),
    (StaticPrefixCache, "_render"), (direct_render, "render"), (StaticPrefixCache, "_prompt"),
    (getattr(tail_pieces, "PieceMemo", None), "tokenize"),
    (render.TemplateRenderer, "tokenize_tail"),
    (StaticPrefixCache, "_cut"),
    (StaticPrefixCache, "_answer"),
]


def timed(owner: Any, name: str, spent: Counter[str]) -> None:
    """Replace ``owner.name`` with a wrapper adding its time to ``spent``."""
    label = f"{getattr(owner, '__name__', owner)}.{name}"
    inner: Callable[..., Any] | None = getattr(owner, name, None) if owner else None
    if inner is None:  # a step an older tree does not have (run on another commit)
        return
    if asyncio.iscoroutinefunction(inner):
        @functools.wraps(inner)
        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return await inner(*args, **kwargs)
            finally:
                spent[label] += time.perf_counter() - started
    else:
        @functools.wraps(inner)
        def wrapper(*args: Any, **kwargs: Any) -> Any:  # type: ignore[misc]
            started = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                spent[label] += time.perf_counter() - started
    setattr(owner, name, wrapper)


def scope(method: str, path: str, body: bytes) -> dict[str, Any]:
    headers = [(b"host", b"bench")]
    if body:
        headers += [(b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode())]
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
            "path": path, "raw_path": path.encode(), "query_string": b"", "headers": headers,
            "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80), "scheme": "http",
            "root_path": ""}


async def call(app: Any, method: str, path: str, body: bytes = b"") -> None:
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.sleep(3600)  # pragma: no cover - the app never reads past the body
        return {}

    status: list[int] = []

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            status.append(message["status"])

    await app(scope(method, path, body), receive, send)
    if status != [200]:
        raise SystemExit(f"{method} {path}: HTTP {status}")


def conversation(turns: int) -> list[dict[str, Any]]:
    """The system prompt, ``turns`` earlier exchanges, and the new request."""
    messages = [{"role": "system", "content": SYSTEM_PROMPT}]
    for i in range(turns):
        messages += [{"role": "user", "content": f"Run the tests of module_{i}.py and fix what "
                                                 "fails; keep the public API as it is."},
                     {"role": "assistant", "content": f"module_{i}.py: 3 tests failed on a "
                                                      "stale fixture; fixed it, all 41 pass."}]
    return messages + [{"role": "user", "content": "Fix the failing test in module_7.py."}]


async def run(requests: int, turns: int = 0) -> tuple[dict[str, float], Counter[str]]:
    app = create_app(make_settings({"tokenize_check_rate": 0.0}))
    messages = conversation(turns)
    hit = json.dumps({"messages": messages, "tools": bench_tools(TOOLS)}).encode()
    requests_of = {"GET /healthz": ("GET", "/healthz", b""),
                   "boundary hit": ("POST", "/v1/prefix/boundary", hit)}
    whole: dict[str, float] = dict.fromkeys(requests_of, 0.0)
    async with app.router.lifespan_context(app):
        for _ in range(50):  # the miss, the memos, the first hits
            await call(app, *requests_of["boundary hit"])
        for _ in range(requests):
            for label, args in requests_of.items():
                started = time.perf_counter()
                await call(app, *args)
                whole[label] += time.perf_counter() - started
        spent: Counter[str] = Counter()
        for owner, name in STEPS:
            timed(owner, name, spent)
        for _ in range(requests):
            await call(app, *requests_of["boundary hit"])
    return {k: v / requests for k, v in whole.items()}, spent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--turns", type=int, default=0,
                        help="earlier exchanges in the conversation (its tail grows with them)")
    args = parser.parse_args()
    whole, spent = asyncio.run(run(args.requests, args.turns))
    print(f"Machine: {machine()}.")
    turns = f" --turns {args.turns}" if args.turns else ""
    print(f"Command: `PYTHONPATH=$PWD python bench/hit_steps.py --requests {args.requests}"
          f"{turns}`\n")
    print("| request (ASGI, every middleware) | mean |\n|---|---:|")
    for label, seconds in whole.items():
        print(f"| {label} | {seconds * 1e6:.1f} µs |")
    print("\n| step of a hit | mean |\n|---|---:|")
    for label, seconds in spent.items():
        print(f"| `{label}` | {seconds / args.requests * 1e6:.1f} µs |")


if __name__ == "__main__":
    main()
