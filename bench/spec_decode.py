"""Speculative decoding (prompt lookup) on against off, side by side in one run (issue 49): the
demo chat model (SmolLM2-135M-Instruct), two in-process engines on the same weights, greedy;
rounds alternate which engine goes first. Workloads: an agent that rewrites a file it was
shown with a small change (the reply repeats the context), and plain chat (a story: drafts
rarely taken, the back-off's case); each single-stream and ``--concurrent`` at once.
Prompts are restored from the conversation store after their first round (decode is what is
measured). Per workload: decode tokens/s (first token to last, summed over the requests of a round),
the on/off ratio per round and its median, acceptance (accepted / drafted), and whether the
tokens were the same.

    LD_PRELOAD=<openblas> PYTHONPATH=. python bench/spec_decode.py [--repeats 3] \
        [--max-tokens 160] [--concurrent 4] [--only agent|chat]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))

from engine import machine  # noqa: E402

FILE = "\n".join(
    [f"def handler_{i}(request, limit={i * 3}):\n"
     f"    \"\"\"Serve request kind {i} within the limit.\"\"\"\n"
     f"    items = fetch_items(request.user, kind={i})\n"
     f"    return [item.name for item in items[:limit]]\n" for i in range(8)])


def agent_messages(i: int) -> list[dict[str, str]]:
    return [{"role": "system", "content": "You are a coding agent. Reply with the whole file."},
            {"role": "user", "content": f"Here is handlers.py:\n\n{FILE}\n\nRewrite the whole "
             f"file with the default limit of handler_{i % 8} doubled. Output only the code."}]


def chat_messages(i: int) -> list[dict[str, str]]:
    topics = ["a lighthouse keeper", "a city garden", "a lost robot", "an old bakery"]
    return [{"role": "user", "content": f"Write a short story about {topics[i % 4]}."}]


def run_round(engine: Any, prompts: list[list[int]], max_tokens: int) -> tuple[float, int,
                                                                               list[list[int]]]:
    """All prompts at once; (decode tokens/s summed over them, tokens, each one's tokens)."""
    from engine_adapter.mlx_engine import GenerationRequest

    events: dict[str, list[tuple[float, int]]] = {f"b{i}": [] for i in range(len(prompts))}
    left = threading.Semaphore(0)

    def deliver(event: Any) -> None:
        assert not isinstance(event, BaseException), event
        events[event.request_id].append((time.perf_counter(), event.token))
        if event.finish_reason:
            left.release()

    with engine.together():
        for i, ids in enumerate(prompts):
            engine.submit(GenerationRequest(ids, request_id=f"b{i}", max_tokens=max_tokens),
                          deliver)
    for _ in prompts:
        left.acquire()
    first = min(e[0][0] for e in events.values())
    last = max(e[-1][0] for e in events.values())
    decoded = sum(len(e) - 1 for e in events.values())
    tokens = [[t for _, t in events[f"b{i}"]] for i in range(len(prompts))]
    return decoded / (last - first), decoded, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--concurrent", type=int, default=4)
    parser.add_argument("--only", choices=["agent", "chat"], default=None,
                        help="run one workload kind (both concurrencies)")
    args = parser.parse_args()

    from mlx_lm import load

    from engine_adapter.demo_model import demo_chat_model_dir
    from engine_adapter.mlx_engine import MLXEngine

    model, tok = load(str(demo_chat_model_dir()))
    stops = sorted(tok.eos_token_ids)
    common = {"stop_token_ids": stops}   # prompts repeat: the conversation store restores them
    engines = {"on": MLXEngine(model, speculative=True, **common),
               "off": MLXEngine(model, speculative=False, **common)}

    def ids(messages: list[dict[str, str]]) -> list[int]:
        return list(tok.apply_chat_template(messages, add_generation_prompt=True))

    workloads = {}
    for n in (1, args.concurrent):
        if args.only != "chat":
            workloads[f"agent edit x{n}"] = [ids(agent_messages(i)) for i in range(n)]
        if args.only != "agent":
            workloads[f"plain chat x{n}"] = [ids(chat_messages(i)) for i in range(n)]
    run_round(engines["on"], workloads["plain chat x1"], 8)   # warm both up
    run_round(engines["off"], workloads["plain chat x1"], 8)
    results = {}
    for name, prompts in workloads.items():
        ratios, rates, same = [], {"on": [], "off": []}, True
        before = engines["on"].snapshot_stats()
        for r in range(args.repeats):
            order = ("on", "off") if r % 2 == 0 else ("off", "on")
            out = {}
            for which in order:
                rate, _, tokens = run_round(engines[which], prompts, args.max_tokens)
                rates[which].append(rate)
                out[which] = (rate, tokens)
            ratios.append(out["on"][0] / out["off"][0])
            same &= out["on"][1] == out["off"][1]
        after = engines["on"].snapshot_stats()
        drafted = after.spec_decode_draft_tokens - before.spec_decode_draft_tokens
        accepted = after.spec_decode_accepted_tokens - before.spec_decode_accepted_tokens
        results[name] = {
            "on_tok_s": round(statistics.median(rates["on"]), 1),
            "off_tok_s": round(statistics.median(rates["off"]), 1),
            "ratio_median": round(statistics.median(ratios), 2),
            "ratios": [round(x, 2) for x in ratios],
            "drafted": drafted, "accepted": accepted,
            "acceptance": round(accepted / drafted, 2) if drafted else None,
            "same_tokens": same,
        }
        print(name, json.dumps(results[name]), flush=True)
    for engine in engines.values():
        engine.close()
    print(json.dumps({"machine": machine(), "load": os.getloadavg(), "repeats": args.repeats,
                      "max_tokens": args.max_tokens, "results": results}, indent=1))


if __name__ == "__main__":
    main()
