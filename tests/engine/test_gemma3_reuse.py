"""Gemma 3 270M (real weights, sliding-window layers: snapshots layered, whole entries only) on
the KV disk tier and with its reply sent back (issue 55, goal 4): after a restart on the same
folder, turn 2 restores turn 1's prompt and reply from disk, counted by the engine's prefill
info; a reply sent back to the same engine is restored from RAM; each first token's logprobs
equal a cold dense forward within the tiny models' tolerance. The prompt outgrows the 512-token
window, so the windowed layers' caches have wrapped. Short turns: only reuse is checked here;
the speed is ``bench/gemma_reuse.py``'s. The checks run in a child process with OpenBLAS
preloaded, as the server processes of other tests are: on mlx's reference BLAS this process
would take minutes over one 700-token prefill of the real model."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

from engine_adapter.mlx_engine import MLXEngine  # noqa: E402
from engine_adapter.mlx_engine.kv import file as kv_file  # noqa: E402
from engine_adapter.mlx_engine.kv.disk import DiskKVStore  # noqa: E402
from engine_adapter.testing.reference import dense_logprobs  # noqa: E402
from tests.support.engine_fixtures import GIB, assert_close, run  # noqa: E402
from tests.support.paths import REPO, openblas  # noqa: E402

GENERATED = 6


def first_prompt(tok: Any) -> tuple[list[int], int]:
    """Turn 1 rendered by Gemma 3's template (system text in the first user turn, about 700
    tokens: past the window) and its static end, as the proxy resolves it."""
    from prefix_cache import StaticPrefixCache

    system = "You keep the warehouse inventory. " + " ".join(
        f"Shelf {i} holds item {i * 7 % 101} in bin {i % 13}." for i in range(60))
    messages = [{"role": "system", "content": system},
                {"role": "user", "content": "Which shelf holds item 17?"}]
    resolved = StaticPrefixCache().resolve(tok, messages)
    return list(resolved.prompt_ids), resolved.specprefill_system_end


def send_back(tok: Any, prompt: list[int], reply: list[int], user: str) -> list[int]:
    """The next turn: ``prompt`` (ending in the model header), the reply's ids as generated,
    then a new user turn and the header, as Gemma 3's template renders them."""
    return prompt + reply + tok.encode(f"<end_of_turn>\n<start_of_turn>user\n{user}"
                                       "<end_of_turn>\n<start_of_turn>model\n",
                                       add_special_tokens=False)


def test_after_a_restart_and_with_a_reply_sent_back_the_turn_is_restored_and_equals_cold(
        gemma_dir, tmp_path):
    env = dict(os.environ)
    blas = openblas()
    if blas:
        env["LD_PRELOAD"] = blas
    code = ("import sys; from pathlib import Path; from tests.engine.test_gemma3_reuse import "
            "check_reuse; check_reuse(Path(sys.argv[1]), Path(sys.argv[2]))")
    done = subprocess.run([sys.executable, "-c", code, str(gemma_dir), str(tmp_path / "kv")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]


def check_reuse(folder: Path, kv_dir: Path) -> None:
    """The test's checks (in the child process)."""
    from mlx_lm import load

    model, tok = load(str(folder))[:2]
    fingerprints = {"target": kv_file.model_fingerprint(model)}

    def start() -> MLXEngine:
        return MLXEngine(model, kv_disk=DiskKVStore(kv_dir, GIB,
                                                    fingerprints=fingerprints))

    first, end = first_prompt(tok)
    assert len(first) > 512
    engine = start()
    try:
        events = run(engine, first, end, max_tokens=GENERATED)
        assert events[-1].finish_reason == "length"
        reply = [e.token for e in events]
    finally:
        engine.close()
        engine.kv_disk.close()
    engine = start()   # the restart: nothing of the first engine's RAM is left
    try:
        second = send_back(tok, first, reply, "And item 23?")
        events = run(engine, second, end, max_tokens=GENERATED)
        info = events[0].prefill
        assert info.conversation_tokens == info.reused_tokens == len(first) + len(reply)
        assert info.reply_tokens == len(reply)
        assert info.prefilled_tokens == len(second) - len(first) - len(reply)
        disk = engine.snapshot_stats().kv_disk
        assert disk.hits >= 1 and disk.discarded == 0
        assert_close(events[0].logprobs, dense_logprobs(model, second))
        # Turn 2's reply sent back to the same engine: restored from RAM.
        reply2 = [e.token for e in events]
        third = send_back(tok, second, reply2, "Thanks.")
        events = run(engine, third, end, max_tokens=1)
        info = events[0].prefill
        assert info.conversation_tokens == len(second) + len(reply2)
        assert info.reply_tokens == len(reply2)
        assert engine.snapshot_stats().kv_disk.hits == disk.hits   # from RAM, not disk
        assert_close(events[0].logprobs, dense_logprobs(model, third))
    finally:
        engine.close()
        engine.kv_disk.close()
