"""An engine that plays back a fixed token list, for the API layers above an engine."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from engine_adapter.mlx_engine import TokenEvent


class ScriptedEngine:
    """Plays back a fixed token list, as MLXEngine.agenerate would, and records closing."""

    vocab_size = None

    def __init__(self, tokens: list[int], stop_token_ids: tuple[int, ...],
                 finish: str = "length") -> None:
        self.tokens, self.stop_token_ids, self.finish = tokens, stop_token_ids, finish
        self.closed_early = False
        self.closed = False
        self.tokenizer = None

    def close(self) -> None:
        self.closed = True

    async def agenerate(self, request: Any) -> AsyncIterator[TokenEvent]:
        done = False
        try:
            for i, token in enumerate(self.tokens):
                last = i == len(self.tokens) - 1
                done = last
                yield TokenEvent(request.request_id, token, i, self.finish if last else None)
        finally:
            self.closed_early = not done
