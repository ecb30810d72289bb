"""What the hit path's cheap checks cost, side by side in one run: the tokenizer fingerprint's
re-check without the added-tokens table, with the whole table (issue 23), the pipeline's reading
alone, and the whole re-check as it is now (table and pipeline read on every call, nothing
watched: issue 48); and the key's canonical bytes with and without the binary-value check.

    PYTHONPATH=$PWD python bench/recheck_cost.py [--reps 2000]

Per tokenizer (real ones, offline), in microseconds per request. Per tools count:
``msgpack.packb`` alone against the fast key packer (the pack, the binary-value scan, the\nnesting memo's hash and lookup).
Medians of interleaved batches, printed as Markdown tables.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

TOKENIZERS = ("qwen3", "qwen3.5", "llama3.1")


def old_settings(tokenizer: Any) -> tuple[Any, ...]:
    """The re-check before issue 23 (no added-tokens table)."""
    return (id(getattr(tokenizer, "backend_tokenizer", None)), len(tokenizer),
            bool(getattr(tokenizer, "split_special_tokens", False)),
            tokenizer.special_tokens_map)


def median_us(calls: dict[str, Callable[[], Any]], reps: int, batch: int = 50) -> dict[str, float]:
    """Median microseconds per call, the candidates interleaved batch by batch."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(max(1, reps // batch)):
        for name, call in calls.items():
            started = time.perf_counter()
            for _ in range(batch):
                call()
            times[name].append((time.perf_counter() - started) / batch)
    return {name: statistics.median(t) * 1e6 for name, t in times.items()}


def table_settings(tokenizer: Any) -> tuple[Any, ...]:
    """The re-check of issue 23: the fields above and the whole added-tokens table."""
    return (*old_settings(tokenizer), tokenizer.backend_tokenizer.get_added_tokens_decoder())


def recheck_rows(reps: int) -> list[str]:
    from prefix_cache.render.tokenizer_identity import TokenizerStates, pipeline_settings
    from prefix_cache.testing.offline_tokenizers import load_offline_tokenizer

    rows = ["| tokenizer | added tokens | before issue 23 (no table) | with the table (issue 23) "
            "| the pipeline alone | the re-check now (issue 48) |",
            "|---|---:|---:|---:|---:|---:|"]
    for name in TOKENIZERS:
        tok = load_offline_tokenizer(name)
        added = len(tok.backend_tokenizer.get_added_tokens_decoder())
        states = TokenizerStates()
        states.state(tok)  # fingerprinted once; the calls below re-check
        us = median_us({"old": lambda t=tok: old_settings(t),
                        "table": lambda t=tok: table_settings(t),
                        "pipeline": lambda t=tok: pipeline_settings(t.backend_tokenizer),
                        "now": lambda t=tok: states.state(t)}, reps)
        rows.append(f"| {name} | {added} | {us['old']:.1f} µs | {us['table']:.1f} µs | "
                    f"{us['pipeline']:.1f} µs | {us['now']:.1f} µs |")
    return rows


def canonical_rows(reps: int) -> list[str]:
    import msgpack

    from prefix_cache.fastpath import FastKeyPacker
    from prefix_cache.testing.benchmark import SYSTEM_PROMPT, bench_tools

    rows = ["| tools | packed bytes | pack alone | canonical_bytes | ratio |",
            "|---:|---:|---:|---:|---:|"]
    static = [{"role": "system", "content": SYSTEM_PROMPT}]
    packer = FastKeyPacker()  # as a cache packs: in C, each new packing walked once
    for n in (0, 4, 64):
        tools = bench_tools(n) or None
        fields = [static, tools, None]
        us = median_us({"pack": lambda f=fields: msgpack.packb(f, strict_types=True),
                        "canonical": lambda t=tools: packer.fields(static, t, None)}, reps)
        size = len(msgpack.packb(fields, strict_types=True))
        rows.append(f"| {n} | {size} | {us['pack']:.1f} µs | {us['canonical']:.1f} µs | "
                    f"{us['canonical'] / us['pack']:.2f}x |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=2000, help="calls per candidate")
    args = parser.parse_args()
    print("Tokenizer fingerprint re-check (every request):\n")
    print("\n".join(recheck_rows(args.reps)))
    print("\nKey material: pack vs pack + binary-value check (every keyed request):\n")
    print("\n".join(canonical_rows(args.reps)))


if __name__ == "__main__":
    main()
