"""Loading a tokenizer (and its chat template) from a model folder, offline."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..errors import NoChatTemplateError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def load_tokenizer(model_dir: str | os.PathLike[str], chat_template_file: str | os.PathLike[str] | None = None,
                   *, require_template: bool = True) -> Any:
    """A fast tokenizer from ``model_dir``'s tokenizer files; weights are never read.

    ``chat_template_file`` overrides the folder's template. With ``require_template`` a folder
    with no template anywhere raises NoChatTemplateError.
    """
    path = Path(model_dir)
    if not path.is_dir():
        raise ValueError(f"model folder {str(path)!r} does not exist")
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        raise ValueError(f"model folder {str(path)!r} has no tokenizer.json or tokenizer_config.json")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local folder never needs the hub
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    if chat_template_file is not None:
        template_path = Path(chat_template_file)
        if not template_path.is_file():
            raise ValueError(f"chat template file {str(template_path)!r} does not exist")
        tokenizer.chat_template = template_path.read_text(encoding="utf-8")
    if require_template and not getattr(tokenizer, "chat_template", None):
        raise NoChatTemplateError(
            f"no chat template: {str(path)!r} has no chat_template.jinja and its "
            "tokenizer_config.json none; pass --chat-template FILE"
        )
    return tokenizer
