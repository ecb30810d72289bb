"""The cost of constrained decoding per decode step: the same batch decoding free and under a
JSON-schema grammar (every row, or one row of the batch), side by side in one run, at batch 1
and 8, on the demo chat model (SmolLM2-135M, float32, a 49,152-token vocabulary).

    bash bench/grammar_mask.sh [--update-docs]        (preloads OpenBLAS)

Each request decodes ``--tokens`` tokens with no stop token: its grammar (an array of at least
10,000 short strings) never completes, so every step computes a real mask. A step's time is
(last event - first event) / (tokens - 1): decode only, prefill excluded. The mask's own parts
(llguidance's bitmask and the boolean row it becomes) are timed alone as well.
"""

from __future__ import annotations

import json
import statistics
import sys
import threading
import time
from typing import Any

from engine_doc import DocBlock, command, machine, whole_run

DOC = DocBlock("grammar")
SCHEMA = {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 10000}
PROMPT = "List as many fruit names as you can, as a JSON array of strings."


def decode_step_s(engine: Any, requests: list[Any]) -> float:
    """Mean seconds per decode step of a batch of requests run together."""
    times: dict[str, list[float]] = {r.request_id: [] for r in requests}
    done = threading.Event()
    lock = threading.Lock()

    def deliver(event: Any) -> None:
        if isinstance(event, BaseException):
            raise event
        with lock:
            times[event.request_id].append(time.perf_counter())
            if all(len(t) == r.max_tokens for r, t in zip(requests, times.values(), strict=True)):
                done.set()

    for request in requests:
        engine.submit(request, deliver)
    done.wait()
    # Steps while the whole batch decodes: from the last first token to the first last token.
    start = max(t[0] for t in times.values())
    end = min(t[-1] for t in times.values())
    steps = min(len([x for x in t if start <= x <= end]) for t in times.values()) - 1
    return (end - start) / max(steps, 1)


def mask_parts_us(cache: Any, grammar: Any, vocab: int, tokens: list[int]) -> tuple[float, float]:
    """(llguidance bitmask, bitmask -> mlx boolean row) in microseconds per step, alone."""
    import mlx.core as mx

    from engine_adapter.mlx_engine.sampling import allowed_tokens

    matcher = cache.matcher(grammar)
    bitmask_s = row_s = 0.0
    for token in tokens:
        started = time.perf_counter()
        bits = matcher.compute_bitmask()
        bitmask_s += time.perf_counter() - started
        started = time.perf_counter()
        mx.eval(mx.array(allowed_tokens(bits, vocab)))
        row_s += time.perf_counter() - started
        matcher.consume_token(token)
    return bitmask_s / len(tokens) * 1e6, row_s / len(tokens) * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = DOC.parser(__doc__)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--reps", type=int, default=2)
    args = parser.parse_args(argv)

    from engine_adapter.backend import MLXBackend
    from engine_adapter.demo_model import demo_chat_model_dir
    from engine_adapter.grammar import output_grammar
    from engine_adapter.mlx_engine import GenerationRequest
    from prefix_cache.engine.protocol import OutputConstraints

    started = time.perf_counter()
    backend = MLXBackend.load(demo_chat_model_dir(), kv_disk_bytes=0, max_batch_size=8,
                              prefill_batch_size=8, reuse_conversation_kv=False)
    engine, tok = backend.engine, backend.tokenizer
    grammar = output_grammar(OutputConstraints({"type": "json_schema", "json_schema": {
        "name": "fruits", "schema": SCHEMA}}), None, None)
    assert grammar is not None
    ids = tok.apply_chat_template([{"role": "user", "content": PROMPT}],
                                  add_generation_prompt=True)

    def batch(size: int, constrained: int) -> list[Any]:
        return [GenerationRequest(ids, max_tokens=args.tokens, stop_token_ids=[],
                                  namespace=f"n{i}", temperature=0.0,
                                  grammar=backend.grammars.run(grammar) if i < constrained
                                  else None) for i in range(size)]

    cases = [(1, 0), (1, 1), (8, 0), (8, 1), (8, 8)]
    decode_step_s(engine, batch(8, 8))  # warm-up: compiles, allocates
    samples: dict[tuple[int, int], list[float]] = {c: [] for c in cases}
    for rep in range(args.reps):
        for case in (cases if rep % 2 == 0 else cases[::-1]):  # order alternates
            samples[case].append(decode_step_s(engine, batch(*case)))
    forced = [e.token for e in engine.generate(batch(1, 1)[0])]
    bitmask_us, row_us = mask_parts_us(backend.grammars, grammar, engine.vocab_size, forced)
    backend.close()

    ms = {c: statistics.median(v) * 1e3 for c, v in samples.items()}
    rows = [
        "| batch | rows under the grammar | ms per decode step (median of "
        f"{args.reps}) | vs the free batch |",
        "|---|---|---|---|",
    ]
    for size, constrained in cases:
        free = ms[(size, 0)]
        rows.append(f"| {size} | {constrained} | {ms[(size, constrained)]:.1f} | "
                    f"{ms[(size, constrained)] / free:.2f}x |")
    text = "\n".join([
        *rows, "",
        f"The mask's parts alone, per step: llguidance's bitmask {bitmask_us:.0f} us, the "
        f"bitmask as an mlx boolean row of {engine.vocab_size} {row_us:.0f} us.", "",
        f"Machine: {machine()}; shared with other jobs (8 engineers on 2 cores: the load "
        f"varies during the run). Command: `{command('bash bench/grammar_mask.sh', argv)}`; "
        f"{args.tokens} tokens a request. {whole_run(started)}",
    ])
    done = DOC.publish(text, args)
    print(json.dumps({f"{s}x{c}": v for (s, c), v in ms.items()}))
    return done


if __name__ == "__main__":
    sys.exit(main())
