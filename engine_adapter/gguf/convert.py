"""Convert a llama or Gemma 3 GGUF into an mlx-lm model folder, offline.

    python -m engine_adapter.gguf.convert SRC.gguf DEST [--dtype float32|float16|bfloat16|quantized]
                                                        [--layers N] [--chat-template FILE]

The folder (config.json, model.safetensors, tokenizer.json, tokenizer_config.json,
chat_template.jinja) loads with ``mlx_lm.load(DEST)``, serves with ``mlx_lm.server`` and with
``prefix-cache serve --engine mlx --model DEST``. ``--layers N`` keeps the first N transformer
layers (a layer-truncated copy: a cheap SpecPrefill draft with the same vocabulary). The folder
is written next to DEST and renamed into place, so a reader never sees half of one. A Gemma 3
GGUF (``gemma3.py``) converts to float32 only, with Gemma 3's chat template unless one is given.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, cast

import mlx.core as mx

from ..folder_cli import folder_parser, print_folder, read_template
from .llama import llama_config, llama_weights
from .tokenizer import write_tokenizer_files, write_tokenizer_json

WEIGHTS_FILE = "model.safetensors"


def read_gguf(path: str | Path) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """(tensors, metadata) of a GGUF file; Q4_0/Q4_1/Q8_0 tensors as MLX affine groups of 32."""
    loaded = mx.load(str(path), return_metadata=True)
    return cast(tuple[dict[str, mx.array], dict[str, Any]], loaded)


def gguf_architecture(path: Path) -> str:
    """``general.architecture`` of a GGUF, read from its header alone."""
    from .gemma3 import GGUFFile

    return str(GGUFFile(path).field("general.architecture"))


def convert_gguf(source: str | Path, dest: str | Path, *, dtype: str = "float32",
                 layers: int | None = None, chat_template: str | None = None) -> Path:
    """Write the mlx-lm folder of the GGUF ``source`` at ``dest`` (replacing it); ``dest``."""
    source, dest = Path(source), Path(dest)
    if not source.is_file():
        raise ValueError(f"GGUF file {str(source)!r} does not exist")
    write = _gemma3_writer if _is_gemma3(source) else _llama_writer
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        staging.chmod(0o755)  # mkdtemp makes it private; the folder is an ordinary one
        write(source, staging, dtype, layers, chat_template)
        _replace(staging, dest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return dest


def _is_gemma3(source: Path) -> bool:
    """Whether ``source`` is a Gemma 3 GGUF (llama.cpp's reader needed; mlx's cannot read it)."""
    try:
        return gguf_architecture(source) == "gemma3"
    except ValueError:  # no gguf package: only what mx.load reads (llama) can convert
        return False


def _write_config(folder: Path, config: dict[str, Any]) -> None:
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def _llama_writer(source: Path, folder: Path, dtype: str, layers: int | None,
                  chat_template: str | None) -> None:
    tensors, metadata = read_gguf(source)
    config = llama_config(metadata, tied="output.weight" not in tensors, layers=layers)
    weights, quantization = llama_weights(tensors, config, dtype)
    config["torch_dtype"] = "float32" if dtype == "quantized" else dtype
    if quantization is not None:
        config["quantization"] = config["quantization_config"] = quantization
    _write_config(folder, config)
    write_tokenizer_files(metadata, folder, chat_template)
    mx.save_safetensors(str(folder / WEIGHTS_FILE), weights, metadata={"format": "mlx"})


def _gemma3_writer(source: Path, folder: Path, dtype: str, layers: int | None,
                   chat_template: str | None) -> None:
    from .gemma3 import GEMMA3_CHAT_TEMPLATE, GGUFFile, gemma3_config, gemma3_tokenizer, \
        gemma3_weights

    gguf = GGUFFile(source)
    config = gemma3_config(gguf, layers=layers)
    weights = {name: mx.array(value) for name, value in gemma3_weights(gguf, config, dtype)}
    config["torch_dtype"] = dtype
    _write_config(folder, config)
    backend, tokenizer_config = gemma3_tokenizer(gguf)
    write_tokenizer_json(backend, tokenizer_config, folder,
                         chat_template if chat_template is not None else GEMMA3_CHAT_TEMPLATE)
    mx.save_safetensors(str(folder / WEIGHTS_FILE), weights, metadata={"format": "mlx"})


def _replace(staging: Path, dest: Path) -> None:
    """Move ``staging`` to ``dest``; an existing ``dest`` is moved aside first and removed."""
    if dest.exists():
        old = dest.with_name(f".{dest.name}.old-{staging.name}")
        dest.rename(old)
        staging.rename(dest)
        shutil.rmtree(old, ignore_errors=True)
    else:
        staging.rename(dest)


def main(argv: list[str] | None = None) -> int:
    parser = folder_parser("engine_adapter.gguf.convert", __doc__, "the GGUF's")
    parser.add_argument("source", type=Path, help="the .gguf file (llama or gemma3)")
    parser.add_argument("dest", type=Path, help="the model folder to write (replaced)")
    parser.add_argument("--dtype", default="float32",
                        choices=("float32", "float16", "bfloat16", "quantized"),
                        help="float32 dequantizes (the fast dtype on CPU); quantized keeps the "
                             "GGUF's 4/8-bit blocks")
    parser.add_argument("--layers", type=int, help="keep only the first N layers")
    args = parser.parse_args(argv)
    return print_folder("convert", lambda: convert_gguf(
        args.source, args.dest, dtype=args.dtype, layers=args.layers,
        chat_template=read_template(args.chat_template)))


if __name__ == "__main__":
    sys.exit(main())
