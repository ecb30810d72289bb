"""Does the SpecPrefill draft find the answer? For layer-truncated copies of the demo chat model
(and the whole model), how often the chunk holding the answer is among those SpecPrefill keeps.

    bash bench/draft_recall.sh [--prompts 10] [--layers 4,6,10,16,24,30] [--update-docs]

``--layers`` takes depths (``6``: a copy of the first 6 layers) and layer-skipping drafts
(``0-4+26-30``: the target's layers 0-3 and 26-29 in one stack, its weights shared; the
self-speculative drafts of Draft & Verify and LayerSkip, which keep the last layers).

The agent turns of ``bench/engine_quality.py`` (a postmortem, a question on one fact of it). Per
turn and draft, exactly what the engine does for the cached boundary (d): the draft's static
prefix is in its cache, ``score_tokens`` scores what follows it (8 lookahead steps), and
``select_chunks`` keeps 20% of the chunks (the last 64 tokens always). Reported: on how many turns
the answer's first token is kept, the median rank of its chunk among the scored chunks (1 = the
draft's top choice), and the median scoring time.
"""

from __future__ import annotations

import copy
import statistics
import sys
import time
from typing import Any

from agent_workload import agent_prompt
from engine_doc import DocBlock, command, machine, whole_run

DOC = DocBlock("recall")
CHUNK, TAIL, KEEP = 32, 64, 0.2


def answer_position(tok: Any, ids: list[int], answer: str) -> int:
    """Index of the first token of the answer's mention in the pasted document."""
    text = tok.decode(ids)
    start = text.find(answer, text.find("Answer from this postmortem"))
    offsets = tok(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    return next(i for i, (a, b) in enumerate(offsets) if a <= start < b)


def layer_ranges(spec: str, full: int) -> list[int]:
    """``0-4+26-30`` -> [0, 1, 2, 3, 26, 27, 28, 29] (half-open ranges, in order)."""
    out: list[int] = []
    for part in spec.split("+"):
        lo, hi = (int(x) for x in part.split("-"))
        if not 0 <= lo < hi <= full:
            raise SystemExit(f"--layers: {part!r} is not a range of layers 0-{full}")
        out += range(lo, hi)
    if out != sorted(set(out)):
        raise SystemExit(f"--layers: {spec!r} must list increasing, disjoint ranges")
    return out


def draft_name(spec: str, full: int) -> str:
    parts = [f"{lo}-{int(hi) - 1}" for lo, hi in (p.split("-") for p in spec.split("+"))]
    return f"layers {' and '.join(parts)} ({len(layer_ranges(spec, full))}, skipping the rest)"


def layer_view(target: Any, indices: list[int]) -> Any:
    """The target with only the layers at ``indices`` (shared weights, nothing copied)."""
    view, inner = copy.copy(target), copy.copy(target.model)
    inner.layers = [target.model.layers[i] for i in indices]
    view.model = inner
    return view


def main(argv: list[str] | None = None) -> int:
    parser = DOC.parser(__doc__)
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--layers", default="4,6,10,16,24,30",
                        help="draft depths (30: the whole model)")
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
    target, wrapper = load(str(demo_chat_model_dir()))[:2]
    layers = args.layers.split(",")
    full = int(target.args.num_hidden_layers)

    def draft_for(spec: str) -> Any:
        if not spec.isdigit():
            return layer_view(target, layer_ranges(spec, full))
        return target if int(spec) == full else load_model(demo_chat_model_dir(layers=int(spec)))[0]

    drafts = {n: draft_for(n) for n in layers}
    tok = unwrap_tokenizer(wrapper)
    cache = StaticPrefixCache()
    kept: dict[str, int] = dict.fromkeys(layers, 0)
    ranks: dict[str, list[int]] = {n: [] for n in layers}
    seconds: dict[str, list[float]] = {n: [] for n in layers}
    for turn in range(args.prompts):
        prompt = agent_prompt(turn)
        result = cache.resolve(tok, prompt.messages, prompt.tools)
        ids, end = result.prompt_ids, result.specprefill_system_end
        needle = answer_position(tok, ids, prompt.answer) - end
        for n, draft in drafts.items():
            draft_cache = make_prompt_cache(draft)
            draft(mx.array(ids[:end])[None], cache=draft_cache)
            mx.eval([c.state for c in draft_cache])
            t0 = time.perf_counter()
            importance = score_tokens(draft, ids, end, draft_cache)
            seconds[n].append(time.perf_counter() - t0)
            keep = select_chunks(importance, KEEP, CHUNK, TAIL)
            kept[n] += needle in keep
            scores = importance.tolist()
            means = [statistics.mean(scores[c:c + CHUNK]) for c in range(0, len(scores), CHUNK)]
            ranks[n].append(1 + sum(m > means[needle // CHUNK] for m in means))
        mx.clear_cache()
    lines = [f"Machine: {machine()}.",
             f"Command: `{command('bash bench/draft_recall.sh', argv)}`. {args.prompts} turns, "
             f"~{len(means)} chunks of {CHUNK} "
             f"scored per turn, {KEEP:.0%} kept (the last {TAIL} tokens always).", "",
             "| draft | answer kept | answer chunk's rank (median; each turn) | scoring time "
             "(median) |", "|---|---:|---|---:|"]
    for n in layers:
        name = (draft_name(n, full) if not n.isdigit() else
                f"the whole model ({n} layers)" if int(n) == full else f"first {n} layers")
        lines.append(f"| {name} | {kept[n]}/{args.prompts} | {statistics.median(ranks[n]):.0f} "
                     f"({', '.join(map(str, ranks[n]))}) | "
                     f"{statistics.median(seconds[n]) * 1000:.0f} ms |")
    return DOC.publish("\n".join([*lines, "", whole_run(started), ""]), args)


if __name__ == "__main__":
    sys.exit(main())
