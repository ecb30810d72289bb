"""Independent references the cache is checked against, written apart from prefix_cache, over a
tokenizer's own ``apply_chat_template`` (the definition itself: engine_adapter/testing/two_probe.py).

Nothing here imports prefix_cache: the point is to recompute the answer another way.
"""

from __future__ import annotations

from typing import Any

from engine_adapter.testing import two_probe as reference
from engine_adapter.testing.two_probe import cpl, leading_static

UNRELATED_TEXTS = (
    "Hi",
    "Tell me a joke.",
    "What is the capital of France?",
    "¿Dónde está la biblioteca?",
)


def render(tok: Any, messages: list[dict], tools: list | None, kwargs: dict | None,
           template: str | None, tokenize: bool = True, options: dict | None = None) -> Any:
    """apply_chat_template of ``tok`` itself (a tokenizer, or a wrapper with its own method),
    tools as given; tools=None falls back to [] for templates that need a list. ``options``:
    add_generation_prompt / continue_final_message as the request gives them."""
    def call(t: list | None) -> Any:
        extra: dict[str, Any] = {} if template is None else {"chat_template": template}
        if type(tok).__module__.startswith("transformers"):
            extra["return_dict"] = False
        extra.update({"add_generation_prompt": True, **(options or {})})
        return tok.apply_chat_template(
            messages, tools=t, tokenize=tokenize, **extra, **(kwargs or {}))
    if tools is not None:
        return call(tools)
    try:
        return call(None)
    except Exception:
        return call([])


def _ids_of(tok: Any, tools: list | None, kwargs: dict | None, template: str | None,
            options: dict | None) -> Any:
    return lambda messages: render(tok, messages, tools, kwargs, template, options=options)


def two_probe(tok: Any, messages: list[dict], tools: list | None = None,
              kwargs: dict | None = None, template: str | None = None,
              options: dict | None = None) -> int:
    """The reference algorithm of ARCHITECTURE.md, straight from its definition (the probes
    always with the generation prompt; the prompt as the request renders it)."""
    return reference.two_probe(_ids_of(tok, tools, kwargs, template, options), messages,
                               _ids_of(tok, tools, kwargs, template, None))


def first_text_start(tok: Any, messages: list[dict], tools: list | None = None,
                     kwargs: dict | None = None, template: str | None = None,
                     options: dict | None = None) -> int:
    """Token index where the first non-static message's content starts in the rendered prompt."""
    return reference.first_text_start(_ids_of(tok, tools, kwargs, template, options), messages)


def exact(tok: Any, messages: list[dict], tools: list | None = None,
          kwargs: dict | None = None, template: str | None = None,
          options: dict | None = None) -> int:
    """The contract: the two-probe answer, never past the first non-static message's text."""
    return reference.exact(_ids_of(tok, tools, kwargs, template, options), messages,
                           _ids_of(tok, tools, kwargs, template, None))


def multi_probe(tok: Any, messages: list[dict], tools: list | None = None,
                kwargs: dict | None = None, template: str | None = None,
                static: list[dict] | None = None) -> int:
    """Brute force: the longest prefix the prompt shares with renders of many unrelated user texts."""
    static = leading_static(messages) if static is None else static
    if len(static) == len(messages):
        return 0
    prompt = render(tok, messages, tools, kwargs, template)
    n = len(prompt)
    for text in UNRELATED_TEXTS:
        probe = render(tok, static + [{"role": "user", "content": text}], tools, kwargs, template)
        n = min(n, cpl(prompt, probe))
    return n


def first_user_text_index(tok: Any, messages: list[dict], tools: list | None = None,
                          kwargs: dict | None = None, template: str | None = None) -> int:
    """Token index where the first user message's text starts in the rendered prompt."""
    first = next(m for m in messages if m["role"] == "user")
    content = first["content"]
    if not isinstance(content, str):
        content = next(p["text"] for p in content if p.get("type") == "text")
    text = render(tok, messages, tools, kwargs, template, tokenize=False)
    pos = text.find(content.strip())
    assert pos >= 0, "first user text not found in the rendered prompt"
    ids = tok.encode(text, add_special_tokens=False)  # a wrapper passes encode through
    head = tok.encode(text[:pos], add_special_tokens=False)
    return cpl(ids, head)
