"""What one prefill model call costs on the tiny model, by chunk size and depth (issue 52): the
fixed cost of a call against the cost per token, which sizes the step's budget.

    LD_PRELOAD=<openblas> PYTHONPATH=$PWD python bench/prefill_call.py [--depths 0,2048]
        [--chunks 1,16,32,64,128,256,512,1024] [--repeats 5]

Per (depth, chunk): a fresh cache filled to ``depth`` tokens, then one call of ``chunk`` tokens
with only the cache evaluated (as ``prefill.ChunkedPrefill`` does); the median over repeats.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--depths", default="0,2048")
    parser.add_argument("--chunks", default="1,16,32,64,128,256,512,1024")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()

    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model

    from engine_adapter.mlx_engine.model_info import vocab_size
    from engine_adapter.testing.tiny_model import tiny_model_folder

    with tempfile.TemporaryDirectory() as tmp:
        folder = tiny_model_folder(Path(tmp) / "tiny", hidden=args.hidden, layers=args.layers)
        model = load_model(folder)[0]
    vocab = vocab_size(model) or 32000

    def call_ms(chunk: int, depth: int) -> float:
        times = []
        for _ in range(args.repeats):
            cache = make_prompt_cache(model)
            if depth:
                model(mx.array([[i % vocab for i in range(depth)]]), cache=cache)
                mx.eval([c.state for c in cache])
            ids = mx.array([[(i * 7) % vocab for i in range(chunk)]])
            started = time.perf_counter()
            model(ids, cache=cache)
            mx.eval([c.state for c in cache])
            times.append(time.perf_counter() - started)
        return statistics.median(times) * 1000

    call_ms(16, 0)                                       # the first call builds kernels
    chunks = [int(c) for c in args.chunks.split(",")]
    print("| depth | " + " | ".join(f"{c} tokens" for c in chunks) + " |")
    print("|---|" + "---|" * len(chunks))
    for depth in (int(d) for d in args.depths.split(",")):
        print(f"| {depth} | " + " | ".join(f"{call_ms(c, depth):.1f} ms" for c in chunks) + " |")


if __name__ == "__main__":
    main()
