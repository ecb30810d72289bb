"""Independent references the cache is checked against, written apart from prefix_cache.

Nothing here imports prefix_cache: the point is to recompute the answer another way.
"""

from __future__ import annotations

from typing import Any

STATIC = ("system", "developer")
UNRELATED_TEXTS = (
    "Hi",
    "Tell me a joke.",
    "What is the capital of France?",
    "¿Dónde está la biblioteca?",
)


def cpl(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


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


def leading_static(messages: list[dict]) -> list[dict]:
    out = []
    for m in messages:
        if m["role"] not in STATIC:
            break
        out.append(m)
    return out


def two_probe(tok: Any, messages: list[dict], tools: list | None = None,
              kwargs: dict | None = None, template: str | None = None,
              options: dict | None = None) -> int:
    """The reference algorithm of ARCHITECTURE.md, straight from its definition (the probes
    always with the generation prompt; the prompt as the request renders it)."""
    static = leading_static(messages)
    if not static or len(static) == len(messages):
        return 0
    prompt = render(tok, messages, tools, kwargs, template, options=options)
    a = render(tok, static + [{"role": "user", "content": "Hi"}], tools, kwargs, template)
    b = render(tok, static + [{"role": "user", "content": "Tell me a joke."}], tools, kwargs, template)
    return cpl(prompt, a[: cpl(a, b)])


def first_text_start(tok: Any, messages: list[dict], tools: list | None = None,
                     kwargs: dict | None = None, template: str | None = None,
                     options: dict | None = None) -> int:
    """Token index where the first non-static message's content starts in the rendered prompt:
    where the prompt leaves a render of the same conversation with that content replaced by a
    text whose first character differs."""
    n = len(leading_static(messages))
    first = messages[n]
    content = first.get("content")
    lead = content if isinstance(content, str) else ""
    if isinstance(content, list) and content and isinstance(content[0].get("text"), str):
        lead = content[0]["text"]
    other = "Tell me a joke." if lead.startswith("H") else "Hi"
    replaced = [*messages[:n], {**first, "content": other}, *messages[n + 1:]]
    return cpl(render(tok, messages, tools, kwargs, template, options=options),
               render(tok, replaced, tools, kwargs, template, options=options))


def exact(tok: Any, messages: list[dict], tools: list | None = None,
          kwargs: dict | None = None, template: str | None = None,
          options: dict | None = None) -> int:
    """The contract: the two-probe answer, never past the first non-static message's text."""
    static = leading_static(messages)
    if not static or len(static) == len(messages):
        return 0
    return min(two_probe(tok, messages, tools, kwargs, template, options),
               first_text_start(tok, messages, tools, kwargs, template, options))


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
