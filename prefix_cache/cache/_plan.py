"""A request's plan: its inputs validated, its renderer and its key, everything decided before
any render (pure but for the renderer lookup and the clock of templates that read it)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from . import boundary, keys
from .messages import count_static, validate_kwargs, validate_messages, validate_tools
from ..render.render import (
    DEFAULT_OPTIONS,
    Renderers,
    RenderOptions,
    TemplateRenderer,
)


@dataclass(frozen=True, slots=True)
class Plan:
    """Everything resolved before any render: validated inputs, renderer and key."""

    renderer: TemplateRenderer
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    kwargs: dict[str, Any]
    n_static: int
    static: list[dict[str, Any]] | None  # None: nothing to protect, boundary 0
    key: str
    check: int
    date: str | None     # the date in the key (templates that read today's date)
    namespace: str
    model: str
    started: float
    options: RenderOptions = DEFAULT_OPTIONS  # how the prompt itself is rendered
    json_messages: bool = False  # every message is JSON a body parser made (the packer knows)

    @property
    def probe_shape(self) -> bool:
        return boundary.is_probe_shape(self.messages, self.n_static)

    @property
    def cached(self) -> bool:
        """Whether this request reads and writes the store (it has a key)."""
        return bool(self.key)


def make_plan(tokenizer: Any, messages: Any, tools: Any, kwargs: Any,
              chat_template: str | None, namespace: str, model: str | None,
              options: RenderOptions = DEFAULT_OPTIONS, *, prefix: str,
              protect_default_prefix: bool, renderers: Renderers,
              packer: keys.KeyPacker) -> Plan:
    """Validates a request's inputs, picks its renderer and computes its key (none when there
is nothing static to protect, or when the render cannot be reproduced). ``renderers``: the
cache's own (its renderers and tokenizer states); ``packer``: what packs the key's fields, for
this request (``KeyPacker.request``)."""
    started = time.perf_counter()
    keys.validate_label(namespace, "namespace")
    messages = validate_messages(messages)
    json_messages = packer.all_json(messages)
    tools = validate_tools(tools, packer.frozen(tools))
    kwargs = validate_kwargs(kwargs)
    renderer = renderers.get(tokenizer, chat_template, tools)
    n_static = count_static(messages)
    everything_static = n_static == len(messages)
    label = keys.model_label(model or getattr(renderer.tokenizer, "name_or_path", "") or "model")
    if everything_static or (n_static == 0 and not protect_default_prefix):
        # Not keyed, but refused alike: what would be refused in a key is refused here too.
        packer.fields(messages[:n_static], tools, kwargs)
        return Plan(renderer, messages, tools, kwargs, n_static, None, "", 0, None,
                     namespace, label, started, options, json_messages)
    static = messages[:n_static]
    if renderer.uncacheable is not None:  # no key: computed like a miss, never stored
        packer.fields(static, tools, kwargs)
        return Plan(renderer, messages, tools, kwargs, n_static, static, "", 0, None,
                     namespace, label, started, options, json_messages)
    date = renderer.date_tag()
    material = keys.key_material(
        namespace=namespace, identity=renderer.identity, static=static,
        tools=tools, kwargs=kwargs, date=date, packer=packer,
    )
    key = keys.format_key(prefix, namespace, label, keys.key_hash(material))
    return Plan(renderer, messages, tools, kwargs, n_static, static, key,
                 keys.check_value(material), date, namespace, label, started, options,
                 json_messages)
