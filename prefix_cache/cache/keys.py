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
from functools import lru_cache
from typing import Any

import msgpack
import xxhash

from ..errors import InvalidRequestError

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


@lru_cache(maxsize=1024)  # a pure function of a few model names, called on every request
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
    the ``tool_use`` named template), so they key differently. Nesting deeper than
    ``MAX_DEPTH`` levels is refused (one limit, one error, wherever the value is: a render
    walks it recursively).

    Binary values (``bytes``, ``bytearray``, ``memoryview``) and msgpack's own ``ExtType`` and
    ``Timestamp`` are refused too: msgpack would pack them, but the first three alike and an
    ``ExtType`` like one of our big integers, while the template sees each differently. So are
    strings that are not valid Unicode text (a lone surrogate).

    The bytes are a msgpack array of the fields of ``KEY_FIELDS``, in its order, each value
    walked in Python (``_plain``) and packed. The accelerated packer (``fastpath``) packs the
    same bytes in C and must refuse exactly what this refuses.
    """
    given = (static, tools, kwargs or None)
    return _pack([_plain(value, field.name)
                  for value, field in zip(values(given), KEY_FIELDS, strict=True)])


class KeyPacker:
    """The key's field bytes, the plain way (``canonical_bytes``). The accelerated packer
    (``prefix_cache.fastpath``) wraps one and gives the same bytes and the same refusals."""

    def fields(self, static: Sequence[Mapping[str, Any]],
               tools: Sequence[Mapping[str, Any]] | None,
               kwargs: Mapping[str, Any] | None) -> bytes:
        """The key's field bytes for these inputs; InvalidRequestError for what is refused."""
        return canonical_bytes(static, tools, kwargs)

    def request(self, tools: Any, hints: Any) -> tuple[Any, KeyPacker]:
        """(``tools`` as this packer takes them, the packer for one request). The plain packer
        uses no hints (what a body's parse packed), and reads a frozen tool list back as the
        plain list it stands for (``fastpath.FrozenTools``: whatever has ``unfrozen()``)."""
        unfrozen = getattr(tools, "unfrozen", None)
        return (unfrozen() if callable(unfrozen) else tools), self

    def frozen(self, tools: Any) -> bool:
        """Whether ``tools`` is a tool list checked when it was frozen (not to check again)."""
        return False

    def all_json(self, messages: Sequence[Any]) -> bool:
        """Whether every message is JSON a body parser made, nothing changed (rendered
        without transformers' copies by the accelerated renderer)."""
        return False


@dataclass(frozen=True, slots=True)
class KeyField:
    """One field of the key material: its name (what a refusal names), the plain type the
    template gets it as, and whether hints may stand for each of its items (the static
    messages, parsed one by one) rather than for the whole value."""

    name: str
    shape: type
    by_item: bool = False


# The key's fields, in order (``canonical_bytes``: a msgpack array of them; None packs as nil).
KEY_FIELDS = (KeyField("messages", list, by_item=True), KeyField("tools", list),
              KeyField("chat_template_kwargs", dict))


def values(given: tuple[Any, ...]) -> list[Any]:
    """The fields as the template gets them, in the table's shapes (None stays None)."""
    return [None if value is None else field.shape(value)
            for value, field in zip(given, KEY_FIELDS, strict=True)]


def packed_array(parts: list[bytes]) -> bytes:
    """A msgpack array of already packed elements: its header, then each element's bytes
    (what msgpack itself writes for the array of their values)."""
    return b"".join([_array_header(len(parts)), *parts])


def packed_part(value: Any) -> bytes | None:
    """``value`` packed as ``canonical_bytes`` packs it among its fields, when it is plain data
    msgpack takes as it is (no integer beyond 64 bits, no lone surrogate); else None. Its
    nesting is not checked: msgpack packs up to 1024 levels, past ``MAX_DEPTH``."""
    try:
        packed = _pack(value)
    except (TypeError, OverflowError, ValueError):
        return None
    return None if _has_binary(packed) else packed


def packed_field(value: Any, what: str) -> bytes:
    """``value`` packed exactly as ``canonical_bytes`` packs it as its field ``what`` (one of
    ``messages``, ``tools``, ``chat_template_kwargs``), integers beyond 64 bits included;
    InvalidRequestError for what it refuses (walked in Python: its nesting is checked)."""
    return _pack(_plain(value, what))


def unpack_ext(code: int, data: bytes) -> Any:
    """msgpack's ``ext_hook`` for what ``_plain`` packs as an extension: an integer beyond 64
    bits, in decimal digits."""
    if code != _BIG_INT:
        raise ValueError(f"msgpack extension type {code} is not key material")
    return int(data.decode())


_NIL = msgpack.packb(None)


def _array_header(length: int) -> bytes:
    """msgpack's header of an array of ``length`` elements (fixarray, array 16, array 32)."""
    if length < 16:
        return bytes([0x90 | length])
    if length < 1 << 16:
        return b"\xdc" + length.to_bytes(2, "big")
    return b"\xdd" + length.to_bytes(4, "big")


def _has_binary(packed: bytes) -> bool:
    """Whether msgpack output holds a bin or ext value (what only a refused type packs to).

    Plain data packs without any bin/ext type byte (0xc4-0xc9, 0xd4-0xd8) unless such a byte
    stands inside a string, a number or a length: a few ``in`` scans (memchr, microseconds)
    clear almost every request. When one is there, a C unpack that refuses any non-empty bin
    and any ext but a timestamp decides; an empty bin or a timestamp is looked for by its bytes
    (a false alarm there only costs the Python walk, which is exact).
    """
    if not any(marker in packed for marker in _BIN_EXT_BYTES):
        return False
    if any(seq in packed for seq in _UNCHECKED_SEQUENCES):
        return True
    try:
        msgpack.unpackb(packed, max_bin_len=0, ext_hook=_ext_found, strict_map_key=False)
    except (ValueError, TypeError):
        return True
    return False


def _ext_found(code: int, data: bytes) -> Any:
    raise TypeError(f"msgpack extension type {code}")


# Type bytes of bin 8/16/32, ext 8/16/32 and fixext 1/2/4/8/16.
_BIN_EXT_BYTES = tuple(bytes([b]) for b in (*range(0xC4, 0xCA), *range(0xD4, 0xD9)))
# What the unpack check lets through: an empty bin, and msgpack timestamps (ext type -1, which
# unpacks natively): 32-, 64- and 96-bit forms.
_UNCHECKED_SEQUENCES = (b"\xc4\x00", b"\xd6\xff", b"\xd7\xff", b"\xc7\x0c\xff")


def _pack(value: Any) -> bytes:
    return msgpack.packb(value, strict_types=True)


_PLAIN_SCALARS = (float, bool, type(None))
MAX_DEPTH = 256
_INT64_MIN, _UINT64_MAX = -(2**63), 2**64 - 1
_BIG_INT = 1  # msgpack extension type code for an integer beyond 64 bits (decimal digits)


def _plain(value: Any, path: str, depth: int = 0) -> Any:
    """A copy of ``value`` with big integers as msgpack extensions; refuses non-plain types."""
    if depth > MAX_DEPTH:
        raise InvalidRequestError(f"{path}: nested more than {MAX_DEPTH} levels deep")
    kind = type(value)
    if kind is int:
        if _INT64_MIN <= value <= _UINT64_MAX:
            return value
        return msgpack.ExtType(_BIG_INT, str(value).encode())
    if kind is str:
        return _text(value, path)
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


def _text(value: str, path: str) -> str:
    """``value`` if it is Unicode text; a lone surrogate cannot be encoded, rendered or sent."""
    try:
        value.encode()
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(
            f"{path} holds a lone surrogate ({value[exc.start]!r} at {exc.start}): not Unicode "
            "text") from None
    return value


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
    packer: KeyPacker | None = None,
) -> bytes:
    """Length-prefixed fields, so no field's bytes can run into the next one's. ``packer``:
    what packs the static messages, tools and kwargs (the plain one when None)."""
    packed = (_PLAIN if packer is None else packer).fields(static, tools, kwargs)
    fields = (KEY_VERSION, namespace.encode(), identity, (date or "").encode(), packed)
    return b"".join([len(f).to_bytes(4, "little") + f for f in fields])


_PLAIN = KeyPacker()


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
