"""Convert a llama GGUF into an mlx-lm model folder, offline.

    python -m engine_adapter.gguf.convert SRC.gguf DEST [--dtype float32|float16|bfloat16|quantized]
                                                        [--layers N] [--chat-template FILE]

The folder (config.json, model.safetensors, tokenizer.json, tokenizer_config.json,
chat_template.jinja) loads with ``mlx_lm.load(DEST)``, serves with ``mlx_lm.server`` and with
``prefix-cache serve --engine mlx --model DEST``. ``--layers N`` keeps the first N transformer
layers (a layer-truncated copy: a cheap SpecPrefill draft with the same vocabulary). The folder
is written next to DEST and renamed into place, so a reader never sees half of one.
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
from .tokenizer import write_tokenizer_files

WEIGHTS_FILE = "model.safetensors"


def read_gguf(path: str | Path) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """(tensors, metadata) of a GGUF file; Q4_0/Q4_1/Q8_0 tensors as MLX affine groups of 32."""
    loaded = mx.load(str(path), return_metadata=True)
    return cast(tuple[dict[str, mx.array], dict[str, Any]], loaded)


def convert_gguf(source: str | Path, dest: str | Path, *, dtype: str = "float32",
                 layers: int | None = None, chat_template: str | None = None) -> Path:
    """Write the mlx-lm folder of the GGUF ``source`` at ``dest`` (replacing it); ``dest``."""
    source, dest = Path(source), Path(dest)
    if not source.is_file():
        raise ValueError(f"GGUF file {str(source)!r} does not exist")
    tensors, metadata = read_gguf(source)
    config = llama_config(metadata, tied="output.weight" not in tensors, layers=layers)
    weights, quantization = llama_weights(tensors, config, dtype)
    config["torch_dtype"] = "float32" if dtype == "quantized" else dtype
    if quantization is not None:
        config["quantization"] = config["quantization_config"] = quantization
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        staging.chmod(0o755)  # mkdtemp makes it private; the folder is an ordinary one
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n",
                                             encoding="utf-8")
        write_tokenizer_files(metadata, staging, chat_template)
        mx.save_safetensors(str(staging / WEIGHTS_FILE), weights, metadata={"format": "mlx"})
        _replace(staging, dest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return dest


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
    parser.add_argument("source", type=Path, help="the .gguf file")
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
