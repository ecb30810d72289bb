"""``prefix-cache serve``'s flags, generated from the settings model: one flag per field that
declares one, its help from the field's description, default and variable, and every variable
listed after the flags in ``--help``."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from pydantic.fields import FieldInfo

from ..demo import HOME_ENV
from ..tokenizer_folders import CACHE_ENV
from .settings import ServiceSettings, env_name


def _flag_of(info: FieldInfo) -> dict[str, Any] | None:
    extra = info.json_schema_extra
    return extra if isinstance(extra, dict) and "flag" in extra else None


def _dest(flag: dict[str, Any]) -> str:
    """The argparse destination of a flag: its name (``--engine-option`` -> engine_option)."""
    return str(flag["flag"]).lstrip("-").replace("-", "_")


def _default(info: FieldInfo) -> Any:
    if info.default_factory is not None:
        return None
    return info.default


def _help(name: str, info: FieldInfo) -> str:
    default = _default(info)
    shown = f"default {default}; " if default not in (None, "") else ""
    return f"{info.description} ({shown}env {env_name(name)})"


def add_serve_flags(parser: argparse.ArgumentParser) -> None:
    """The settings' flags on ``parser``, and the variables of every setting in its epilog."""
    for name, info in ServiceSettings.model_fields.items():
        flag = _flag_of(info)
        if flag is None:
            continue
        parser.add_argument(flag["flag"], dest=_dest(flag), metavar=flag["metavar"],
                            action="append" if flag["repeat"] else "store",
                            help=_help(name, info).replace("%", "%%"))
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    rows = [f"  {env_name(name):<42} {info.description}"
            + (f" ({_default(info)})" if _default(info) not in (None, "") else "")
            for name, info in ServiceSettings.model_fields.items() if _flag_of(info) is None]
    rows += [f"  {HOME_ENV:<42} folder the demo models are made in, with no model given "
             "(with --engine mlx, the demo chat model converted there) (~/.cache/prefix-cache)",
             f"  {CACHE_ENV:<42} disk cache of the tokenizers built offline "
             "(~/.cache/prefix-cache/tokenizers)"]
    parser.epilog = ("settings without a flag (the flags' variables are in their help), and "
                     "where files are made:\n" + "\n".join(rows))


def flag_overrides(args: Mapping[str, Any]) -> dict[str, Any]:
    """The settings the flags set explicitly (an absent flag leaves the environment's value),
    from the parsed flags by destination."""
    overrides = {}
    for name, info in ServiceSettings.model_fields.items():
        flag = _flag_of(info)
        if flag is not None and args.get(_dest(flag)) is not None:
            overrides[name] = args[_dest(flag)]
    return overrides
