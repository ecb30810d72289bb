"""What SpecPrefill keeps of the document, with and without the boundary: the frontier's open
point (issue 26, part 1) measured instead of guessed.

    bash bench/kept_coverage.sh [--prompts 10] [--keeps 0.2,0.35,0.5,0.75]

On the frontier's turns (``bench/engine_frontier.py``: the agent's system prompt and tools, a
~950-token postmortem, a question on one of its facts), exactly as the engine chooses: the
6-layer draft scores what follows the protected part (``score_tokens``: the whole prompt for
(b) no boundary, what follows the cached boundary for (d)), and ``select_chunks`` keeps the
share (chunks of 32, the last 64 tokens always). Reported per keep share: how much of the
document each keeps, how much of the static prefix (b) keeps (its share spent there), and on
how many turns the answer's first token is kept.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(BENCH))

from agent_workload import agent_prompt, incident_report  # noqa: E402
from draft_recall import answer_position  # noqa: E402
from engine import machine  # noqa: E402

CHUNK, TAIL, FILLER = 32, 64, 24


def span_of(tok: Any, ids: list[int], needle: str) -> tuple[int, int]:
    """Token positions [start, end) of ``needle``'s first occurrence in the decoded prompt."""
    text = tok.decode(ids)
    at = text.find(needle)
    if at < 0:
        raise SystemExit("the document is not in the prompt's text")
    offsets = tok(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    inside = [i for i, (a, b) in enumerate(offsets) if a < at + len(needle) and b > at]
    return inside[0], inside[-1] + 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--keeps", type=lambda s: [float(x) for x in s.split(",")],
                        default=[0.2, 0.35, 0.5, 0.75])
    parser.add_argument("--draft-layers", type=int, default=6)
    args = parser.parse_args(argv)

    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model

    from engine_adapter.demo_model import demo_chat_model_dir
    from engine_adapter.mlx_engine.specprefill import score_tokens, select_chunks
    from prefix_cache import StaticPrefixCache
    from prefix_cache.render.render import unwrap_tokenizer

    started = time.perf_counter()
    wrapper = load(str(demo_chat_model_dir()))[1]
    draft = load_model(demo_chat_model_dir(layers=args.draft_layers))[0]
    tok = unwrap_tokenizer(wrapper)
    cache = StaticPrefixCache()
    rows: dict[tuple[str, float], dict[str, list[float]]] = {
        (v, k): {"doc": [], "static": [], "answer": []} for v in "bd" for k in args.keeps}
    sizes = []
    for turn in range(args.prompts):
        prompt = agent_prompt(turn)
        document = incident_report(random.Random(turn), FILLER)[0]
        result = cache.resolve(tok, prompt.messages, prompt.tools)
        ids, end = result.prompt_ids, result.specprefill_system_end
        doc = span_of(tok, ids, document)
        answer = answer_position(tok, ids, prompt.answer)
        sizes.append((len(ids), end, doc[1] - doc[0]))
        for variant in "bd":
            draft_cache = make_prompt_cache(draft)
            start = end if variant == "d" else 0
            if start:
                draft(mx.array(ids[:start])[None], cache=draft_cache)
                mx.eval([c.state for c in draft_cache])
            importance = score_tokens(draft, ids, start, draft_cache)
            for keep in args.keeps:
                kept = {start + i for i in select_chunks(importance, keep, CHUNK, TAIL)}
                row = rows[(variant, keep)]
                row["doc"].append(len(kept & set(range(*doc))) / (doc[1] - doc[0]))
                row["static"].append(len(kept & set(range(end))) / end)
                row["answer"].append(answer in kept)
        mx.clear_cache()
    command = "bash bench/kept_coverage.sh" + "".join(f" {a}" for a in (argv or sys.argv[1:]))
    n = args.prompts
    lines = [f"Machine: {machine()}.",
             f"Command: `{command}`. {n} turns: prompts {min(s[0] for s in sizes)}-"
             f"{max(s[0] for s in sizes)} tokens, cached boundary {sizes[0][1]}, documents "
             f"{min(s[2] for s in sizes)}-{max(s[2] for s in sizes)} tokens; draft: the first "
             f"{args.draft_layers} layers; chunks of {CHUNK}, the last {TAIL} tokens always kept.",
             "", "| keep | (b) document kept | (d) document kept | (b) static prefix kept | "
             "answer kept (b) / (d) |", "|---:|---:|---:|---:|---:|"]
    for keep in args.keeps:
        b, d = rows[("b", keep)], rows[("d", keep)]
        lines.append(f"| {keep:.0%} | {statistics.mean(b['doc']):.0%} | "
                     f"{statistics.mean(d['doc']):.0%} | {statistics.mean(b['static']):.0%} | "
                     f"{sum(b['answer']):.0f}/{n} / {sum(d['answer']):.0f}/{n} |")
    lines += ["", "(Means over the turns; (d) keeps all of the static prefix by construction.)",
              f"Whole run: {time.perf_counter() - started:.0f} s.", ""]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
