"""Hit path A/B: this tree's StaticPrefixCache against another commit's, side by side in one process.

    PYTHONPATH=$PWD python bench/hit_ab.py --base main [--reps 10] [--tools 0,1,4,16,64]

The base commit's ``prefix_cache`` package is extracted (``git archive``) into a temporary folder
and imported as ``prefix_cache_base`` (its modules import each other relatively). Both caches
serve the same hits (real Qwen3.5 tokenizer, the Qwen3.5 template when ../shared has it, prompt
ids given) in a freshly shuffled order per request; medians and the ratio are printed as a
Markdown table. Both must give the same boundary.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import io
import random
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = ROOT.parent / "shared" / "chat_templates" / "Qwen3.5-4B.jinja"


def import_base(ref: str, into: Path) -> Any:
    """The ``prefix_cache`` package of commit ``ref``, imported as ``prefix_cache_base``."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "prefix_cache"],
                             check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    (into / "prefix_cache").rename(into / "prefix_cache_base")
    sys.path.insert(0, str(into))
    return importlib.import_module("prefix_cache_base")


def run(base: Any, tools_counts: list[int], reps: int) -> list[str]:
    import prefix_cache
    from prefix_cache.testing.benchmark import SYSTEM_PROMPT, bench_tools
    from prefix_cache.testing.offline_tokenizers import load_offline_tokenizer

    tok = load_offline_tokenizer("qwen3.5")
    template = TEMPLATE.read_text() if TEMPLATE.is_file() else None
    rows = ["| tools | boundary | base hit (median) | this hit (median) | this / base |",
            "|---:|---:|---:|---:|---:|"]
    for n in tools_counts:
        tools = bench_tools(n) or None
        system = {"role": "system", "content": SYSTEM_PROMPT}
        requests = []
        for i in range(50):
            messages = [system, {"role": "user", "content": f"Request {i}: fix module_{i}.py"}]
            ids = tok.apply_chat_template(messages, tools=tools, chat_template=template,
                                          add_generation_prompt=True, tokenize=True, return_dict=False)
            requests.append((messages, list(ids)))
        caches = {"base": base.StaticPrefixCache(), "this": prefix_cache.StaticPrefixCache()}
        times: dict[str, list[float]] = {name: [] for name in caches}
        ends: dict[str, set[int]] = {name: set() for name in caches}
        order = list(caches)
        rng = random.Random(n)
        gc.disable()
        try:
            for _ in range(reps + 1):
                for messages, ids in requests:
                    rng.shuffle(order)
                    for name in order:
                        started = time.perf_counter()
                        r = caches[name].resolve(tok, messages, tools, prompt_ids=ids,
                                                 chat_template=template)
                        times[name].append(time.perf_counter() - started)
                        ends[name].add(r.specprefill_system_end)
        finally:
            gc.enable()
        if ends["base"] != ends["this"]:
            raise SystemExit(f"{n} tools: the boundaries differ: {ends}")
        # The first pass holds each cache's miss; the medians are over hits.
        base_us, this_us = (statistics.median(times[k][len(requests):]) * 1e6 for k in ("base", "this"))
        rows.append(f"| {n} | {ends['this'].pop()} | {base_us:.1f} µs | {this_us:.1f} µs | "
                    f"**{this_us / base_us:.2f}x** |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="main", help="the commit to compare with (default main)")
    parser.add_argument("--reps", type=int, default=10, help="passes over 50 requests per row")
    parser.add_argument("--tools", default="0,1,4,16,64", help="tool counts, comma-separated")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base = import_base(args.base, Path(tmp))
        rows = run(base, [int(t) for t in args.tools.split(",")], args.reps)
    print(f"Hit path, this tree vs {args.base}, {args.reps} passes of 50 hits per row:\n")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
