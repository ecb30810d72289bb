"""The real engine with its replies scripted, for clients' tool loops on a tiny random-weights
model (which cannot write a tool call itself): each request is prefilled by the real
``MLXEngine`` (its KV reuse, static prefix and conversation, is real and counted), then the
one token it sampled is replaced by the reply the scripted upstream would give, written as the
model family writes tool calls (Qwen3's ``<tool_call>`` JSON), for the server's own parser.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

from .tool_loop_upstream import TOOLS, ANSWER, TITLE, TOOL_CALLS, LoopRecorder


@dataclass
class Prefill:
    tools: bool            # the prompt offered tools (the loop, not a title request)
    prompt_tokens: int
    static_tokens: int
    reused_tokens: int


class ToolLoopEngine:
    """Wraps an MLXEngine (everything but ``agenerate`` is the engine's own)."""

    def __init__(self, engine: Any, tokenizer: Any, rec: LoopRecorder) -> None:
        self.engine, self.tok, self.rec = engine, tokenizer, rec
        self.prefills: list[Prefill] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def reply(self, prompt: str) -> str:
        """The rule of ``tool_loop_upstream.next_step``, read from the rendered prompt."""
        if "<tools>" not in prompt:
            return TITLE
        results = prompt.count("<tool_response>")
        if results >= TOOL_CALLS:
            return ANSWER
        for name, args in TOOLS:
            if f'"name": "{name}"' in prompt:
                call = {"name": name, "arguments": args(self.rec.files[results])}
                return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"
        return ANSWER

    async def agenerate(self, request: Any) -> AsyncIterator[Any]:
        from engine_adapter.mlx_engine import TokenEvent

        first = None
        async for event in self.engine.agenerate(replace(request, max_tokens=1)):
            first = first or event
        assert first is not None and first.prefill is not None
        prompt = self.tok.decode(list(request.prompt_ids))
        info = first.prefill
        self.prefills.append(Prefill("<tools>" in prompt, info.prompt_tokens,
                                     info.static_tokens, info.reused_tokens))
        ids = self.tok.encode(self.reply(prompt), add_special_tokens=False)
        ids = ids[: max(1, request.max_tokens)]
        for i, token in enumerate(ids):
            last = i == len(ids) - 1
            yield TokenEvent(request.request_id, token, i, "stop" if last else None,
                             prefill=info if i == 0 else None)
