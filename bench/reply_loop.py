"""A chat loop that sends the model's reply back (issue 43): our engine with and without the
reply's KV kept (``reuse_reply_kv``), side by side in one run, turns alternating between the two
engines; per turn the prompt tokens, the tokens restored (of them, generated ones) and the time to
first token. Greedy, so both engines see the same conversation. mlx_lm.server and vllm-mlx side
by side are a later step.

    python bench/reply_loop.py [--turns 6] [--max-tokens 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics

from engine_adapter.demo_model import demo_chat_model_dir
from engine_adapter.mlx_engine import GenerationRequest, MLXEngine

QUESTIONS = ["Tell me about the history of tea.", "And coffee?", "Which has more caffeine?",
             "Summarise what you said so far.", "Give me one more fact.", "Thanks, goodbye."]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="whole conversations, each "
                        "in a fresh namespace; per turn the median TTFT")
    args = parser.parse_args()
    from mlx_lm import load

    model, tok = load(str(demo_chat_model_dir()))[:2]
    stops = sorted(tok.eos_token_ids)
    engines = {"reply kept": MLXEngine(model, stop_token_ids=stops),
               "prompt only": MLXEngine(model, stop_token_ids=stops, reuse_reply_kv=False)}
    rows: dict[tuple[str, int], list[tuple[int, int, int, float]]] = {}
    try:
        for rep in range(args.repeats):
            messages: list[dict[str, str]] = [
                {"role": "system", "content": "You are a concise, friendly assistant."}]
            for t in range(args.turns):
                messages.append({"role": "user", "content": QUESTIONS[t % len(QUESTIONS)]})
                ids = list(tok.apply_chat_template(messages, add_generation_prompt=True))
                reply: list[int] = []
                for name, engine in engines.items():   # alternating, same prompt
                    req = GenerationRequest(ids, max_tokens=args.max_tokens,
                                            namespace=f"r{rep}")
                    events = list(engine.generate(req))
                    info = events[0].prefill
                    rows.setdefault((name, t), []).append(
                        (len(ids), info.reused_tokens, info.reply_tokens, events[0].elapsed_s))
                    reply = [e.token for e in events if e.token not in stops]
                messages.append({"role": "assistant", "content": tok.decode(reply)})
    finally:
        for engine in engines.values():
            engine.close()
    print(f"turns={args.turns} max_tokens={args.max_tokens} repeats={args.repeats} "
          "(median TTFT per turn)")
    print("turn | prompt | kept: reused (generated) ttft ms | prompt only: reused ttft ms | "
          "TTFT ratio (prompt only / kept)")
    for t in range(args.turns):
        a, b = rows[("reply kept", t)], rows[("prompt only", t)]
        ta = statistics.median(r[3] for r in a) * 1e3
        tb = statistics.median(r[3] for r in b) * 1e3
        print(f"{t + 1} | {a[-1][0]} | {a[-1][1]} ({a[-1][2]}) {ta:.1f} | {b[-1][1]} "
              f"{tb:.1f} | {tb / ta:.2f}x")


if __name__ == "__main__":
    main()
