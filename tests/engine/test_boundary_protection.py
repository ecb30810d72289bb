"""With its boundary, a SpecPrefilled request never sparsifies its static prefix, whatever the
engine's stores held before: on the demo chat model's real weights and tokenizer (the first 4
layers of SmolLM2-135M-Instruct as the target, its first 2 as the draft), every position before
the boundary is among the positions the request's KV holds.

The defect this pins down: the same prompt SpecPrefilled first with boundary 0 left its kept
tokens in the conversation store, and the request with its real boundary restored them, so its
system prompt was sparsified after all.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mlx_lm")


KEEP = 0.2
# The same weights computing the same tokens in the same chunks, on two engines.
ATOL = 1e-3
# Short on a loaded two-core machine, where this process runs mlx on the reference BLAS (no
# OpenBLAS preloaded): the whole 30-layer model on ~600 prompt tokens took 16.5 minutes there.
# ~250 tokens are enough for SpecPrefill (threshold 64, a 32-token tail) to drop most of them;
# what is kept does not depend on the target's depth.
WORDS = 150
TARGET_LAYERS = 4
# The whole module's engine work may take this long (about 100 s measured at load 8 on two
# cores); past it, the next request fails the test with a message instead of the suite running
# on silently.
BUDGET_S = 600.0


def _document(words: int) -> str:
    """A long paste: numbered log lines about a made-up outage."""
    lines, n = [], 0
    while n < words:
        line = (f"{n // 12:03d} worker-{n % 7} retried the upload of batch {n * 37 % 1000} after "
                f"a timeout of {n % 9 + 1} seconds.")
        lines.append(line)
        n += len(line.split())
    return "\n".join(lines)


@pytest.fixture(scope="module")
def demo_target_dir(gguf_path: Path) -> Path:
    """The demo chat model's first layers, converted once per machine."""
    from engine_adapter.demo_model import demo_chat_model_dir

    return demo_chat_model_dir(layers=TARGET_LAYERS)


@pytest.fixture(scope="module")
def demo(demo_target_dir: Path, demo_chat_2l_dir: Path) -> dict[str, Any]:
    """The demo model and draft, the prompt (a fact in the system prompt, ~600 tokens of
    document, a question about the fact), its boundary, and a sibling prompt."""
    from mlx_lm import load
    from mlx_lm.utils import load_model

    from prefix_cache import StaticPrefixCache
    from prefix_cache.render.render import unwrap_tokenizer

    target, wrapper = load(str(demo_target_dir))[:2]
    draft = load_model(demo_chat_2l_dir)[0]
    tok = unwrap_tokenizer(wrapper)
    system = {"role": "system", "content": "You are the on-call assistant. The code word of "
              "this team is PELICAN. Answer in one short sentence."}

    def prompt(words: int, question: str) -> tuple[list[int], int]:
        messages = [system, {"role": "user",
                             "content": f"{_document(words)}\n\n{question}"}]
        result = StaticPrefixCache().resolve(tok, messages)
        return list(result.prompt_ids), result.specprefill_system_end

    ids, end = prompt(WORDS, "What is the code word of this team?")
    sibling, sibling_end = prompt(WORDS, "Which worker retried most?")
    assert sibling_end == end and 0 < end < 100 and len(ids) > 3 * end
    return {"target": target, "draft": draft, "stop": sorted(wrapper.eos_token_ids),
            "ids": ids, "end": end, "sibling": sibling,
            "deadline": time.monotonic() + BUDGET_S, "sent": 0}


def _engine(demo: dict[str, Any]) -> Any:
    from engine_adapter.mlx_engine import MLXEngine, SpecPrefillConfig

    config = SpecPrefillConfig(keep_pct=KEEP, threshold=64, tail_tokens=32)
    return MLXEngine(demo["target"], draft_model=demo["draft"], specprefill=config,
                     stop_token_ids=demo["stop"])


def _send(demo: dict[str, Any], engine: Any, ids: list[int], end: int, namespace: str,
          **fields: Any) -> list[Any]:
    from engine_adapter.mlx_engine import GenerationRequest

    if time.monotonic() > demo["deadline"]:
        pytest.fail(f"over the module's budget of {BUDGET_S:.0f} s after {demo['sent']} "
                    f"requests (load average {os.getloadavg()[0]:.1f}): the machine is too "
                    "loaded, or the engine got slower")
    demo["sent"] += 1
    # Two tokens: the prompt's KV is stored after the first, before the second is delivered.
    return list(engine.generate(GenerationRequest(ids, max_tokens=2, specprefill_system_end=end,
                                                  namespace=namespace, return_logprobs=True,
                                                  **fields)))


def _kept(engine: Any, ids: list[int], namespace: str) -> set[int]:
    """The prompt positions whose KV the request held, from the entry it stored."""
    hit = engine.conversation_store.longest_common_prefix(namespace, "target", ids,
                                                          len(ids) - 1)
    assert hit is not None and hit[0] == len(ids) - 1
    snap = hit[1]
    # The prompt's entry, or (once stored, just after the last token is delivered) the finished
    # request's that supersedes it: the prompt and the two tokens it generated (``reply``).
    # Both hold the same positions before ``len(ids) - 1``.
    assert snap.prompt_tokens == len(ids) - 1 or (snap.prompt_tokens == len(ids) + 2
                                                  and snap.reply_from == len(ids))
    span = len(ids) - 1
    return set(range(span) if snap.positions is None else snap.positions) & set(range(span))


def _assert_protected(engine: Any, ids: list[int], end: int, namespace: str, name: str) -> None:
    missing = sorted(set(range(end)) - _kept(engine, ids, namespace))
    assert not missing, f"after {name}: {len(missing)} static positions dropped"


# What the engine's stores hold before the request: (name, prompt, boundary, request fields,
# whether the request must then compute exactly as on a fresh engine: all the earlier entry holds
# dense is within the boundary, so nothing of it may serve).
History = tuple[str, str, int | str, dict[str, Any], bool]
HISTORIES: list[History] = [
    ("the same prompt, boundary 0", "ids", 0, {}, True),
    ("the same prompt, half its boundary", "ids", "half", {}, True),
    ("the same prompt, boundary 0 at another keep share", "ids", 0,
     {"specprefill_keep_pct": 0.5}, True),
    ("a sibling prompt, boundary 0", "sibling", 0, {}, True),
    # These may restore what the earlier request left dense, past the boundary too.
    ("the same prompt, its boundary at another keep share", "ids", "end",
     {"specprefill_keep_pct": 0.5}, False),
    ("the same prompt, dense", "ids", "end", {"specprefill": False}, False),
]


def _boundary(spec: int | str, end: int) -> int:
    """A history's boundary: a number, or the prompt's boundary ("end") or half of it."""
    if isinstance(spec, int):
        return spec
    return {"end": end, "half": end // 2}[spec]


@pytest.fixture(scope="module")
def engines(demo: dict[str, Any]) -> Iterator[tuple[Any, Any]]:
    """A fresh engine (the reference) and one whose stores the cases fill, one namespace each."""
    fresh, engine = _engine(demo), _engine(demo)
    yield fresh, engine
    fresh.close()
    engine.close()


@pytest.fixture(scope="module")
def alone(demo: dict[str, Any], engines: tuple[Any, Any]) -> list[Any]:
    """The request on the fresh engine: SpecPrefilled, its static prefix whole."""
    fresh = engines[0]
    events = _send(demo, fresh, demo["ids"], demo["end"], "alone")
    assert events[0].prefill.mode == "specprefill"
    assert set(range(demo["end"])) <= _kept(fresh, demo["ids"], "alone")
    return events


@pytest.mark.parametrize("k", range(len(HISTORIES)), ids=[h[0] for h in HISTORIES])
def test_the_static_prefix_is_never_sparsified_whatever_the_stores_held(
        demo: dict[str, Any], engines: tuple[Any, Any], alone: list[Any], k: int) -> None:
    ids, end, engine = demo["ids"], demo["end"], engines[1]
    name, which, boundary, fields, computes = HISTORIES[k]
    _send(demo, engine, demo[which], _boundary(boundary, end), f"case-{k}", **fields)
    events = _send(demo, engine, ids, end, f"case-{k}")
    _assert_protected(engine, ids, end, f"case-{k}", name)
    if computes:
        # The request computes as it does on a fresh engine, and answers the same.
        info = events[0].prefill
        assert info.mode == "specprefill" and info.conversation_tokens == 0, name
        diff = abs(events[0].logprobs - alone[0].logprobs).max().item()
        assert diff < ATOL, f"after {name}: first-token logprobs differ by {diff}"
        assert [e.token for e in events] == [e.token for e in alone], name


def test_one_namespace_that_held_every_history_in_turn(demo: dict[str, Any],
                                                      engines: tuple[Any, Any]) -> None:
    ids, end, engine = demo["ids"], demo["end"], engines[1]
    for _, which, boundary, fields, _ in HISTORIES:
        _send(demo, engine, demo[which], _boundary(boundary, end), "all", **fields)
    _send(demo, engine, ids, end, "all")
    _assert_protected(engine, ids, end, "all", "all of them")
