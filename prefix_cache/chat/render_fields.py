"""The request-level fields of a chat body that change the engine's render, read the way vLLM's
chat completions read them. Each is either rendered (and, where it changes the static part,
keyed) exactly, or refused with a 400 naming it; none is forwarded while the boundary is cut
in another render. The decision per field is listed in docs/agent-apis.md.

Rendered: ``chat_template`` (template text, or the name of one of the model's templates: a
different template is a different key), ``add_generation_prompt`` and
``continue_final_message`` (how the prompt itself ends; the boundary is cut against that
prompt), ``documents`` and ``reasoning_effort`` (template variables: merged into
``chat_template_kwargs``, which win when they set the same name, so they are keyed).
Refused: ``add_special_tokens: true`` (a BOS the render does not have) and
``truncate_prompt_tokens`` (a prompt cut off at its start).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import InvalidRequestError
from .conversation import Conversation
from .fields import INVALID, UNSUPPORTED, bool_field

# Top-level fields that are template variables (vLLM hands them to the render).
TEMPLATE_VARIABLES = ("documents", "reasoning_effort")


def chat_conversation(body: Mapping[str, Any]) -> Conversation:
    """What the template renders for an OpenAI chat body; InvalidRequestError naming a field
    that changes the render and cannot be rendered exactly."""
    _refuse_unrenderable(body)
    template = body.get("chat_template")
    if template is not None and (not isinstance(template, str) or not template):
        raise InvalidRequestError("chat_template must be a non-empty string (template text or "
                                  "the name of one of the model's templates)", code=INVALID)
    generation = bool_field(body, "add_generation_prompt")
    continued = bool_field(body, "continue_final_message")
    if continued and generation:
        raise InvalidRequestError("continue_final_message and add_generation_prompt cannot both "
                                  "be true", code=INVALID)
    return Conversation(
        body.get("messages"),  # type: ignore[arg-type]
        body.get("tools"),
        _template_kwargs(body),
        chat_template=template,
        add_generation_prompt=not continued if generation is None else generation,
        continue_final_message=bool(continued),
    )


def _template_kwargs(body: Mapping[str, Any]) -> Any:
    """``chat_template_kwargs`` with the top-level template variables under it (its own win)."""
    kwargs = body.get("chat_template_kwargs")
    extra = {name: body[name] for name in TEMPLATE_VARIABLES if body.get(name) is not None}
    if "documents" in extra and not (isinstance(extra["documents"], list) and all(
            isinstance(d, dict) for d in extra["documents"])):
        raise InvalidRequestError("documents must be a list of objects", code=INVALID)
    if not extra or not isinstance(kwargs, (dict, type(None))):
        return kwargs  # a bad chat_template_kwargs is refused where it is checked
    return {**extra, **(kwargs or {})}


def _refuse_unrenderable(body: Mapping[str, Any]) -> None:
    if bool_field(body, "add_special_tokens"):
        raise InvalidRequestError("add_special_tokens: true adds tokens the chat template does "
                                  "not render; the boundary would be cut in another prompt",
                                  code=UNSUPPORTED)
    if body.get("truncate_prompt_tokens") is not None:
        raise InvalidRequestError("truncate_prompt_tokens cuts the prompt's start, where the "
                                  "static prefix is: not supported", code=UNSUPPORTED)
