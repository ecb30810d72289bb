"""The servers' flags, generated from their settings models (``serve``: ``ServiceSettings``,
``serve-engine``: ``EngineServerSettings``): one flag per field that declares one, its help
from the field's description, default and variable, and every variable without a flag listed
after the flags in ``--help``. Nothing here names a flag or a variable by hand."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings

from ..model_folders.demo import HOME_ENV
from ..model_folders.tokenizer_folders import CACHE_ENV
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


def _help(name: str, info: FieldInfo, settings: type[BaseSettings]) -> str:
    default = _default(info)
    shown = f"default {default}; " if default not in (None, "", False) else ""
    return f"{info.description} ({shown}env {env_name(name, settings)})"


def add_flags(parser: argparse.ArgumentParser, settings: type[BaseSettings]) -> None:
    """The flags of ``settings``' fields on ``parser``."""
    for name, info in settings.model_fields.items():
        flag = _flag_of(info)
        if flag is None:
            continue
        help_text = _help(name, info, settings).replace("%", "%%")
        if flag.get("switch"):  # no value; absent leaves the variable's (None: not given)
            parser.add_argument(flag["flag"], dest=_dest(flag), action="store_const",
                                const=True, help=help_text)
            continue
        parser.add_argument(flag["flag"], dest=_dest(flag), metavar=flag["metavar"],
                            action="append" if flag["repeat"] else "store", help=help_text)


def add_serve_flags(parser: argparse.ArgumentParser) -> None:
    """``serve``'s flags on ``parser``, and the variables of every setting in its epilog."""
    add_flags(parser, ServiceSettings)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    rows = [f"  {env_name(name):<42} {info.description}"
            + (f" ({_default(info)})" if _default(info) not in (None, "") else "")
            for name, info in ServiceSettings.model_fields.items() if _flag_of(info) is None]
    rows += [f"  {HOME_ENV:<42} folder the demo models are made in, with no model given "
             "(with --engine mlx, the demo chat model converted there) (~/.cache/prefix-cache)",
             f"  {CACHE_ENV:<42} disk cache of the tokenizers built offline "
             "(~/.cache/prefix-cache/tokenizers)",
             # read by every StaticPrefixCache (prefix_cache.fastpath), not a service setting
             f"  {'PREFIX_CACHE_FAST_PATH':<42} on|off: off runs the hit path's plain "
             "computation alone, every accelerator off (the same answers) (on)"]
    parser.epilog = ("settings without a flag (the flags' variables are in their help), and "
                     "where files are made:\n" + "\n".join(rows))


def flag_overrides(args: Mapping[str, Any],
                   settings: type[BaseSettings] = ServiceSettings) -> dict[str, Any]:
    """The settings the flags set explicitly (an absent flag leaves the environment's value),
    from the parsed flags by destination."""
    overrides = {}
    for name, info in settings.model_fields.items():
        flag = _flag_of(info)
        if flag is not None and args.get(_dest(flag)) is not None:
            overrides[name] = args[_dest(flag)]
    return overrides
