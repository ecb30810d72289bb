"""The plug-in inside real oMLX against oMLX's own subtraction, side by side in one run.

    PYTHONPATH=. OMLX_VENV/bin/python bench/omlx_plugin.py [--tools 16,64] [--requests 30]
        [--template ../shared/chat_templates/Qwen3.5-4B.jinja] [--models DIR]

Run with the python of a venv that has oMLX (docs/omlx.md). One started BatchedEngine (a tiny
random-weights qwen3 with the real Qwen3 tokenizer). Per request, in a freshly shuffled order:

- stock: what oMLX 0.7.0's ``stream_chat`` does for the boundary, its own calls: a render of the
  non-system messages (its ``_apply_chat_template``) and two ``tokenizer.encode``; and the
  encode of the prompt its scheduler then does (``add_request`` is handed the string);
- hit: the plug-in's ``aprompt`` on a stored static prefix, what the installed hook awaits: the
  boundary and the prompt's ids, handed to the scheduler (which then encodes nothing);
- miss: the same on a new cache (the probe renders), and the longest the event loop went
  without running a 1 ms ticker meanwhile (a miss renders in the cache's threads; oMLX's
  subtraction runs on the loop, so its stall is its own time).

Medians, ms; ratios of medians.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine_adapter.omlx_hooks import unwrapped  # noqa: E402
from engine_adapter.plugin import SpecPrefillBoundary  # noqa: E402
from engine_adapter.testing.omlx_check import SYSTEM, make_tools, omlx_api  # noqa: E402
from engine_adapter.testing.tiny_model import tiny_model_folder  # noqa: E402
from prefix_cache import StaticPrefixCache  # noqa: E402


def messages(i: int) -> list[dict[str, Any]]:
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Request {i}: list the files under src/ and summarize."}]


async def stall_during(work: Any) -> tuple[Any, float]:
    """``await work`` while a 1 ms ticker runs; the result and the ticker's longest gap (ms)."""
    gaps: list[float] = []
    done = False

    async def tick() -> None:
        last = time.perf_counter()
        while not done:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0)
    result = await work
    done = True
    await ticker
    return result, 1000 * max(gaps, default=0.0)


async def bench(tools_counts: list[int], requests: int, template: str | None,
                models: Path) -> None:
    BatchedEngine, convert_tools, _ = omlx_api()
    from engine_adapter.omlx_hooks import omlx_version

    engine = BatchedEngine(str(tiny_model_folder(models / "omlx-target", "qwen3",
                                                 chat_template=template)))
    await engine.start()
    tok = engine._tokenizer
    bare, ct = unwrapped(tok, None)  # what the installed hook hands the cache
    print(f"{omlx_version(engine)}; tokenizer qwen3 (real); {requests} requests per row; "
          f"load average {os.getloadavg()[0]:.1f}\n")
    print("| tools | prompt tokens | stock subtraction | + scheduler encode | plug-in hit "
          "| hit / stock subtraction | hit / (stock + encode) | miss | miss: longest loop stall "
          "| stock: loop stall |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n in tools_counts:
        tools = convert_tools(make_tools(n)) if n else None
        warm = SpecPrefillBoundary(StaticPrefixCache(), tokenizer=bare)
        await warm.aprompt(messages(-1), "", tools, ct, {})  # the static prefix stored
        times: dict[str, list[float]] = {"stock": [], "encode": [], "hit": [], "miss": [],
                                         "stall": []}
        tokens = 0
        for i in range(requests):
            msgs = messages(i)
            prompt = engine._apply_chat_template([dict(m) for m in msgs], tools)
            own = list(tok.encode(prompt))  # oMLX's own ids, to check the plug-in's against
            order = ["stock", "hit", "miss"]
            random.shuffle(order)
            for method in order:
                if method == "stock":  # oMLX 0.7.0 stream_chat's own calls, then its scheduler's
                    t0 = time.perf_counter()
                    rest = engine._apply_chat_template([dict(m) for m in msgs[1:]], tools)
                    end = len(tok.encode(prompt)) - len(tok.encode(rest))
                    t1 = time.perf_counter()
                    tok.encode(prompt)
                    t2 = time.perf_counter()
                    times["stock"].append(t1 - t0)
                    times["encode"].append(t2 - t1)
                    assert end > 0
                elif method == "hit":
                    t0 = time.perf_counter()
                    got = await warm.aprompt(msgs, prompt, tools, ct, {})
                    times["hit"].append(time.perf_counter() - t0)
                    assert got is not None and warm.last is not None and warm.last.hit
                    assert got.ids == own
                    tokens = len(got.ids)
                else:
                    cold = SpecPrefillBoundary(StaticPrefixCache(), tokenizer=bare)
                    t0 = time.perf_counter()
                    got, stall = await stall_during(cold.aprompt(msgs, prompt, tools, ct, {}))
                    times["miss"].append(time.perf_counter() - t0)
                    times["stall"].append(stall / 1000)
                    cold.cache.close()
                    assert got is not None and got.ids == own
        med = {k: 1000 * statistics.median(v) for k, v in times.items()}
        print(f"| {n} | {tokens} | {med['stock']:.2f} ms | {med['encode']:.2f} ms "
              f"| {med['hit']:.3f} ms | **{med['hit'] / med['stock']:.3f}x** "
              f"| {med['hit'] / (med['stock'] + med['encode']):.3f}x | {med['miss']:.1f} ms "
              f"| {med['stall']:.1f} ms | {med['stock']:.1f} ms |")
        warm.cache.close()
    print(f"\nload average after: {os.getloadavg()[0]:.1f}")
    await engine.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tools", default="16,64")
    parser.add_argument("--requests", type=int, default=30)
    parser.add_argument("--template", type=Path,
                        default=Path(__file__).resolve().parents[2] / "shared" /
                        "chat_templates" / "Qwen3.5-4B.jinja")
    parser.add_argument("--models", type=Path, default=Path("/tmp/omlx-bench-models"))
    args = parser.parse_args()
    template = args.template.read_text(encoding="utf-8") if args.template.is_file() else None
    asyncio.run(bench([int(t) for t in args.tools.split(",")], args.requests, template,
                      args.models))
    sys.stdout.flush()
    os._exit(0)  # oMLX's MLX threads can abort the interpreter's teardown


if __name__ == "__main__":
    main()
