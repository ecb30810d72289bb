"""A running stream's inter-token latency while other tenants' long prompts prefill, first come
first served vs the step's token budget, side by side in one run (issue 52); and what the
budget costs a request alone (its TTFT and decode, a short and an 8k-token prompt).

    LD_PRELOAD=<openblas> PYTHONPATH=$PWD python bench/step_itl.py [--long-tokens 8192]
        [--long-streams 2] [--stream-tokens 150] [--repeats 3] [--step-tokens 512,128]
        [--output FILE]

The engine is the real one on a tiny random-weights model (only time matters). Per repeat and
mode (``fair_prefill=False``: mlx-lm's own chunked prefill, first come first served;
``fair_prefill=True``: the budget):

- alone: one stream (a 100-token prompt, ``--stream-tokens`` tokens out), its TTFT and the gaps
  between its tokens; then one ``--long-tokens`` prompt alone, its TTFT;
- loaded: ``--long-streams`` tenants (each its own namespace) keep sending ``--long-tokens``
  prompts (1 token out), and the same stream runs once their first prompts are prefilling;
  the gaps between its tokens, and the long prompts' prefill rate.

Token times are the engine's own (``TokenEvent.elapsed_s``, taken on the engine thread as each
token is emitted), so the client thread's scheduling does not enter the gaps.
"""

from __future__ import annotations

import argparse
import itertools
import platform
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

STREAM_PROMPT = 100


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def stream_times(engine: Any, vocab: int, n: int, seed: int) -> list[float]:
    from engine_adapter.mlx_engine import GenerationRequest

    ids = [(seed * 131 + j * 17) % vocab for j in range(STREAM_PROMPT)]
    return [e.elapsed_s for e in engine.generate(GenerationRequest(
        ids, max_tokens=n, namespace="stream", stop_token_ids=()))]


def gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:], strict=False)]


def run(model: Any, vocab: int, *, budget: int | None, args: argparse.Namespace, seed: int,
        ) -> dict[str, float]:
    from engine_adapter.mlx_engine import GenerationRequest, MLXEngine

    engine = MLXEngine(model, fair_prefill=budget is not None, step_tokens=budget or 512,
                       reuse_static_kv=False, reuse_conversation_kv=False)
    stream_times(engine, vocab, 4, seed + 99)          # warm the model up
    alone = stream_times(engine, vocab, args.stream_tokens, seed)
    long_ids = [(seed * 7 + j * 31) % vocab for j in range(args.long_tokens)]
    long_alone = next(iter(engine.generate(GenerationRequest(long_ids, max_tokens=1)))).elapsed_s
    stop = threading.Event()
    prefilled = [0]
    counter = itertools.count()

    def tenant(k: int) -> None:
        while not stop.is_set():
            n = next(counter)
            ids = [(n * 7919 + j * 31 + seed) % vocab for j in range(args.long_tokens)]
            for _ in engine.generate(GenerationRequest(ids, max_tokens=1,
                                                       namespace=f"long-{k}")):
                pass
            prefilled[0] += args.long_tokens

    threads = [threading.Thread(target=tenant, args=(k,), daemon=True)
               for k in range(args.long_streams)]
    for t in threads:
        t.start()
    time.sleep(args.warmup_s)                          # their prompts are prefilling
    started, before = time.perf_counter(), prefilled[0]
    loaded = stream_times(engine, vocab, args.stream_tokens, seed + 1)
    elapsed = time.perf_counter() - started
    rate = (prefilled[0] - before) / elapsed
    stop.set()
    for t in threads:
        t.join()
    engine.close()
    alone_gaps, loaded_gaps = gaps(alone), gaps(loaded)
    return {"ttft": alone[0], "itl50": statistics.median(alone_gaps),
            "itl99": percentile(alone_gaps, 0.99), "long_ttft": long_alone,
            "loaded50": statistics.median(loaded_gaps),
            "loaded99": percentile(loaded_gaps, 0.99), "long_tok_s": rate}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--long-tokens", type=int, default=8192)
    parser.add_argument("--long-streams", type=int, default=2)
    parser.add_argument("--stream-tokens", type=int, default=150)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--step-tokens", default="512",
                        help="budgets to compare with FCFS, comma-separated: 512,128")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--warmup-s", type=float, default=1.0)
    parser.add_argument("--no-fcfs", action="store_true",
                        help="only the budgets (a run beside another that has FCFS)")
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()

    from mlx_lm.utils import load_model

    from engine_adapter.mlx_engine.model_info import vocab_size
    from engine_adapter.testing.tiny_model import tiny_model_folder

    with tempfile.TemporaryDirectory() as tmp:
        folder = tiny_model_folder(Path(tmp) / "tiny", hidden=args.hidden, layers=args.layers)
        model = load_model(folder)[0]
    vocab = vocab_size(model) or 32000
    budgets = [int(b) for b in args.step_tokens.split(",")]
    modes = [] if args.no_fcfs else [("first come first served", None)]
    modes += [(f"step budget {b}", b) for b in budgets]
    rows = []
    for i in range(args.repeats):
        results = {name: run(model, vocab, budget=b, args=args, seed=i) for name, b in modes}
        fcfs = results.get("first come first served")
        for name, _ in modes:
            r = results[name]
            rows.append(
                f"| {name} | {i + 1} | {r['ttft'] * 1000:.1f} ms | {r['itl50'] * 1000:.2f} ms | "
                f"{r['itl99'] * 1000:.2f} ms | {r['loaded50'] * 1000:.2f} ms | "
                f"{r['loaded99'] * 1000:.1f} ms | {r['loaded99'] / r['itl99']:.1f}x | "
                f"{r['long_ttft'] * 1000:.0f} ms | {r['long_tok_s']:.0f} "
                + (f"({r['long_tok_s'] / fcfs['long_tok_s']:.2f}x) |" if fcfs else "|"))
    lines = [f"A stream ({STREAM_PROMPT}-token prompt, {args.stream_tokens} tokens out) alone and "
             f"while {args.long_streams} other tenants keep {args.long_tokens}-token prompts "
             f"prefilling; tiny random-weights Qwen3 (hidden {args.hidden}, {args.layers} "
             f"layers, float32), prefill batch 8, step 2048; {args.repeats} repeats, the modes "
             f"one after another in each. "
             f"{platform.machine()}, {platform.system()}.", "",
             "| mode | repeat | stream alone: TTFT | ITL p50 | ITL p99 | under long prompts: "
             "ITL p50 | ITL p99 | p99 vs alone | long prompt alone: TTFT | long prompts' "
             "prefill tokens/s (vs FCFS) |", "|---|---|---|---|---|---|---|---|---|---|",
             *rows]
    table = "\n".join(lines)
    print(table)
    if args.output:
        args.output.write_text(table + "\n")


if __name__ == "__main__":
    main()
