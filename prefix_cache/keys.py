"""Cache keys: exact bytes of everything that can change the static render, hashed with xxh3-128.

The key string is ``<prefix>:<namespace>:<model>:<hash>``: namespace and model stay readable so a
tenant or a model can be purged and counted with a SCAN, while the hash covers the rest. A second,
independent hash of the same material (xxh64 under its own seed) travels inside the stored value,
so even a true 128-bit collision is caught on read. The material is the plain data the template
is given, in exact bytes (``canonical_bytes``); anything that is not plain data is refused.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import xxhash

from .errors import InvalidRequestError

KEY_VERSION = b"spc-key-v2"
DEFAULT_PREFIX = "spc"
CHECK_SEED = 0x5A17_C0DE_D00D_F00D

# fullmatch: with "$" a trailing newline would pass ("acme\n"), and end up in keys and patterns.
_LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9._\-]{0,127}")


def validate_label(value: str, what: str) -> str:
    """A namespace, model or prefix label: shown in the clear in keys, so no ':' or glob chars."""
    if not isinstance(value, str) or not _LABEL.fullmatch(value):
        raise ValueError(
            f"{what} {value!r} must be 1-128 characters of letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return value


def model_label(name: str) -> str:
    """Turn any model name or path into a key-safe label (last path part, odd chars replaced)."""
    base = name.rstrip("/").rsplit("/", 1)[-1] or "model"
    label = re.sub(r"[^A-Za-z0-9._\-]", "_", base)[:128]
    return label if label[0].isalnum() else "m" + label[:127]


def canonical_bytes(static: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None,
                    kwargs: Mapping[str, Any] | None) -> bytes:
    """Exact bytes of the plain data a template is given; InvalidRequestError for anything else.

    Plain data is what a JSON body parses to: exactly dict, list, str, int, float, bool and None
    (subclasses excluded: an Enum, a str subclass or a numpy scalar can print differently from
    its value, and transformers' own conversion of such objects has changed between versions).
    Tuples, sets, dates, UUIDs and other objects are refused rather than keyed as the JSON they
    would serialize to, because the template does not see them as that JSON. Key order, int vs
    float, bool vs int, NaN, -0.0 and integers of any size all stay distinct. ``tools`` is kept
    as given: ``[]`` and ``None`` render differently on real templates (``tools is not none``,
    the ``tool_use`` named template), so they key differently.

    msgpack with ``strict_types`` does the type check and the encoding in one C pass; only data
    it cannot take (integers beyond 64 bits, or a type to refuse) goes through the Python walk.
    """
    fields = [list(static), None if tools is None else list(tools), dict(kwargs) if kwargs else None]
    try:
        return _pack(fields)
    except (TypeError, OverflowError, ValueError):
        return _pack([_plain(value, what) for value, what in zip(fields, _FIELD_NAMES, strict=True)])


_FIELD_NAMES = ("messages", "tools", "chat_template_kwargs")


def _pack(value: Any) -> bytes:
    return msgpack.packb(value, strict_types=True)


_PLAIN_SCALARS = (str, float, bool, type(None), bytes)
_MAX_DEPTH = 256
_INT64_MIN, _UINT64_MAX = -(2**63), 2**64 - 1
_BIG_INT = 1  # msgpack extension type code for an integer beyond 64 bits (decimal digits)


def _plain(value: Any, path: str, depth: int = 0) -> Any:
    """A copy of ``value`` with big integers as msgpack extensions; refuses non-plain types."""
    if depth > _MAX_DEPTH:
        raise InvalidRequestError(f"{path}: nested more than {_MAX_DEPTH} levels deep")
    kind = type(value)
    if kind is int:
        if _INT64_MIN <= value <= _UINT64_MAX:
            return value
        return msgpack.ExtType(_BIG_INT, str(value).encode())
    if kind in _PLAIN_SCALARS:
        return value
    if kind is list:
        return [_plain(item, f"{path}[{i}]", depth + 1) for i, item in enumerate(value)]
    if kind is dict:
        return {_plain(k, f"{path} key {k!r}", depth + 1): _plain(v, _child(path, k), depth + 1)
                for k, v in value.items()}
    raise InvalidRequestError(
        f"{path} is a {kind.__module__}.{kind.__qualname__}, not plain JSON data (dict, list, "
        "str, int, float, bool or null): pass what the template should see, e.g. a string "
        "or the enum's .value"
    )


def _child(path: str, key: Any) -> str:
    return f"{path}.{key}" if isinstance(key, str) and key.isidentifier() else f"{path}[{key!r}]"


def key_material(
    *,
    namespace: str,
    identity: bytes,
    static: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    kwargs: Mapping[str, Any] | None,
    date: str | None = None,
) -> bytes:
    """Length-prefixed fields, so no field's bytes can run into the next one's."""
    fields = (KEY_VERSION, namespace.encode(), identity, (date or "").encode(),
              canonical_bytes(static, tools, kwargs))
    return b"".join([len(f).to_bytes(4, "little") + f for f in fields])


def key_hash(material: bytes) -> str:
    """The 128-bit key hash, hex."""
    return xxhash.xxh3_128_hexdigest(material)


def check_value(material: bytes) -> int:
    """The independent 64-bit check stored inside the value."""
    return xxhash.xxh64_intdigest(material, seed=CHECK_SEED)


def format_key(prefix: str, namespace: str, model: str, digest: str) -> str:
    """``<prefix>:<namespace>:<model>:<hash>``."""
    return f"{prefix}:{namespace}:{model}:{digest}"


def key_pattern(prefix: str, namespace: str | None = None, model: str | None = None) -> str:
    """A SCAN/glob pattern over keys of one tenant and/or model."""
    return f"{prefix}:{namespace or '*'}:{model or '*'}:*"


@dataclass(frozen=True, slots=True)
class KeyParts:
    """The fields of a cache key, read back from it."""

    prefix: str
    namespace: str
    model: str
    digest: str


def parse_key(key: str) -> KeyParts | None:
    """The fields of ``<prefix>:<namespace>:<model>:<hash>``; None for a key of another shape
    (labels never hold ':', so a key of ours has exactly four fields)."""
    parts = key.split(":")
    return KeyParts(*parts) if len(parts) == 4 else None
