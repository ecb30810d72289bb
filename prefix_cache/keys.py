"""Cache keys: exact bytes of everything that can change the static render, hashed with xxh3-128.

The key string is ``<prefix>:<namespace>:<model>:<hash>``: namespace and model stay readable so a
tenant or a model can be purged and counted with a SCAN, while the hash covers the rest. A second,
independent hash of the same material (xxh64 under its own seed) travels inside the stored value,
so even a true 128-bit collision is caught on read.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
import xxhash

from .errors import InvalidRequestError

KEY_VERSION = b"spc-key-v1"
DEFAULT_PREFIX = "spc"
CHECK_SEED = 0x5A17_C0DE_D00D_F00D

_LABEL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-]{0,127}$")


def validate_label(value: str, what: str) -> str:
    """A namespace, model or prefix label: shown in the clear in keys, so no ':' or glob chars."""
    if not isinstance(value, str) or not _LABEL.match(value):
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


def canonical_json(value: Any) -> bytes:
    """Exact JSON bytes, key order kept (Jinja's tojson keeps it, so order can change the render).

    orjson writes NaN and infinities as null, which would make them share a key with a real null;
    only output that contains null takes the slower stdlib path, which spells them out.
    """
    if value is None:
        return b"null"
    try:
        data = orjson.dumps(value)
    except TypeError as exc:
        raise InvalidRequestError(f"request is not plain JSON data: {exc}") from exc
    if b"null" in data:
        try:
            text = json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=True)
        except (TypeError, ValueError) as exc:
            raise InvalidRequestError(f"request is not plain JSON data: {exc}") from exc
        data = b"\x00" + text.encode()  # a marker byte keeps the two spellings apart
    return data


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
    fields = (
        KEY_VERSION,
        namespace.encode(),
        identity,
        (date or "").encode(),
        canonical_json(list(static)),
        canonical_json(list(tools) if tools else None),
        canonical_json(dict(kwargs) if kwargs else None),
    )
    return b"".join(len(f).to_bytes(4, "little") + f for f in fields)


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
