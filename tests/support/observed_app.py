"""An ASGI wrapper that keeps, for each POST the app answered, what a test checks of it: the
path, whether the body offered tools, the status, the ``x-prefix-cache`` header and the usage
the answer reported (JSON or SSE, in each API's own fields)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Seen:
    path: str
    tools: bool = False
    status: int = 0
    cache: str | None = None
    answer: bytearray = field(default_factory=bytearray)

    def usage(self) -> tuple[int, int]:
        """(prompt tokens in all, of them cached) as this answer reported them."""
        text = self.answer.decode(errors="replace")
        objects: list[Any] = []
        if text.lstrip().startswith("{"):
            objects.append(json.loads(text))
        else:
            for line in text.splitlines():
                if line.startswith("data:") and line[5:].strip() not in ("", "[DONE]"):
                    objects.append(json.loads(line[5:]))
        found: tuple[int, int] | None = None
        for obj in objects:
            u = (obj.get("usage") or (obj.get("message") or {}).get("usage")
                 or (obj.get("response") or {}).get("usage"))
            if not isinstance(u, dict):
                continue
            if "prompt_tokens" in u:        # chat completions
                found = (u["prompt_tokens"],
                         (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
            elif "input_tokens" in u and "cache_read_input_tokens" in u:   # Anthropic
                cached = u.get("cache_read_input_tokens") or 0
                found = (u["input_tokens"] + cached
                         + (u.get("cache_creation_input_tokens") or 0), cached)
            elif "input_tokens" in u:       # Responses
                found = (u["input_tokens"],
                         (u.get("input_tokens_details") or {}).get("cached_tokens") or 0)
        assert found is not None, f"no usage in the answer to {self.path}: {text[-400:]}"
        return found


class Observed:
    def __init__(self, app: Any) -> None:
        self.app = app
        self.seen: list[Seen] = []

    def posts(self, tools: bool = True) -> list[Seen]:
        return [s for s in self.seen if s.tools == tools]

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        seen = Seen(scope["path"])
        self.seen.append(seen)
        body = bytearray()

        async def receive_body() -> Any:
            message = await receive()
            if message["type"] == "http.request":
                body.extend(message.get("body", b""))
                if not message.get("more_body"):
                    try:
                        seen.tools = bool(json.loads(body).get("tools"))
                    except (ValueError, AttributeError):
                        pass
            return message

        async def send_answer(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                seen.status = message["status"]
                headers = {k.decode().lower(): v.decode() for k, v in message["headers"]}
                seen.cache = headers.get("x-prefix-cache")
            elif message["type"] == "http.response.body":
                seen.answer.extend(message.get("body", b""))
            await send(message)

        await self.app(scope, receive_body, send_answer)
