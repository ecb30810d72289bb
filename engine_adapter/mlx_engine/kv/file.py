"""One KV snapshot as one safetensors file: what is written, how it is read back and checked.

    tensors   k.<layer>, v.<layer>                    (the snapshot's keys and values)
              s.<layer>.<i>                           (a recurrent layer's state arrays)
    metadata  format, version, tier, namespace, model_id, fingerprint (the weights and config
              the KV came from), ids (the packed prefix ids, base64), n_tokens, positions,
              span and keep_pct (sparse snapshots), layers (a layered snapshot's layer kinds:
              full KV, sliding window with its offset, recurrent state), reply_from (where a
              finished sequence's generated ids start: ``reply``), checksum (xxh3_128 of the
              metadata and the tensors together, checked before anything is restored)

Everything a lookup needs before it reads any KV is in the header (``read_header`` reads only
that), so the startup scan costs one small read per file. A file that does not check out on
every point raises ``KVFileError``; its caller deletes it and the KV is computed again.
"""

from __future__ import annotations

import base64
import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, BinaryIO, cast

import mlx.core as mx
import xxhash

from prefix_cache.util.token_ids import pack_ids, unpack_ids

from .cache import KVSnapshot
from .folder import TierFolder
from .layered import LayeredSnapshot, layers_from_arrays, layers_to_arrays

FORMAT = "prefix-cache-kv"
VERSION = 3   # 2: the checksum covers the metadata too; 3: reply_from
# Versions read: a version 2 file is a version 3 one without reply_from, so its KV is restored
# as is and none of it counts as generated (an upgrade keeps the folder's KV). Older: refused.
READS = ("2", "3")
SUFFIX = ".safetensors"
MAX_HEADER_BYTES = 64 << 20  # a header beyond this is not one this module wrote


class KVFileError(ValueError):
    """A KV file that is truncated, corrupt, of another model or of another format version."""


@dataclass(frozen=True, slots=True)
class KVFileHeader:
    """What a KV file's header says (enough for the disk index)."""

    tier: str
    namespace: str
    model_id: str
    fingerprint: str
    packed_ids: bytes
    dense_tokens: int


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def checksum(arrays: Mapping[str, mx.array], meta: Mapping[str, str]) -> str:
    """xxh3_128 of the metadata (all but the checksum) and of every tensor's name, dtype, shape
    and bytes: an edited field fails it as a flipped bit of the KV does."""
    h = xxhash.xxh3_128()
    fields = {k: v for k, v in meta.items() if k != "checksum"}
    h.update(json.dumps(fields, sort_keys=True).encode())
    for name in sorted(arrays):
        array = arrays[name]
        h.update(f"\0{name}\0{array.dtype}\0{array.shape}\0".encode())
        h.update(memoryview(array))
    return h.hexdigest()


def encode(snap: KVSnapshot | LayeredSnapshot, *, tier: str, namespace: str, model_id: str,
           fingerprint: str, packed_ids: bytes) -> tuple[dict[str, mx.array], dict[str, str]]:
    """The tensors and metadata of a snapshot's file (a layered one's layers described in
    ``layers``: sliding windows with their offsets, recurrent state arrays)."""
    arrays: dict[str, mx.array] = {}
    layers = ""
    if isinstance(snap, LayeredSnapshot):
        arrays, kinds = layers_to_arrays(snap)
        layers = json.dumps(kinds)
    else:
        for i, (k, v) in enumerate(snap.layers):
            arrays[f"k.{i}"], arrays[f"v.{i}"] = k, v
    meta = {"format": FORMAT, "version": str(VERSION), "tier": tier, "namespace": namespace,
            "model_id": model_id, "fingerprint": fingerprint, "ids": _b64(packed_ids),
            "n_tokens": str(snap.n_tokens), "dense_tokens": str(snap.dense_tokens),
            "positions": "" if snap.positions is None else _b64(pack_ids(snap.positions)),
            "span": "" if snap.span is None else str(snap.span),
            "keep_pct": "" if snap.keep_pct is None else repr(snap.keep_pct), "layers": layers,
            "reply_from": "" if snap.reply_from is None else str(snap.reply_from)}
    meta["checksum"] = checksum(arrays, meta)
    return arrays, meta


def write(folder: TierFolder, rel: str, arrays: Mapping[str, mx.array],
          meta: Mapping[str, str]) -> None:
    """Write a KV file at ``rel`` in the tier ``folder``, crash-safely and privately (0600: it
    holds what a tenant sent; ``TierFolder.write``)."""
    folder.write(rel, lambda fh: mx.save_safetensors(fh, dict(arrays), metadata=dict(meta)))


def read_header(fh: BinaryIO) -> dict[str, str]:
    """The metadata of a safetensors file open for reading, read without its tensors."""
    raw = fh.read(8)
    if len(raw) != 8:
        raise KVFileError("no safetensors header")
    (size,) = struct.unpack("<Q", raw)
    if size > MAX_HEADER_BYTES:
        raise KVFileError(f"a header of {size} bytes")
    data = fh.read(size)
    if len(data) != size:
        raise KVFileError("truncated header")
    try:
        header = json.loads(data)
    except ValueError as exc:
        raise KVFileError(f"corrupt header: {exc}") from None
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(meta, dict):
        raise KVFileError("no metadata")
    return meta


def check_header(meta: Mapping[str, Any], fingerprints: Mapping[str, str]) -> KVFileHeader:
    """The header of one of our files, for a model this engine runs; KVFileError otherwise."""
    if meta.get("format") != FORMAT or meta.get("version") not in READS:
        raise KVFileError(f"format {meta.get('format')!r} version {meta.get('version')!r}")
    model_id = str(meta.get("model_id"))
    if model_id not in fingerprints or meta.get("fingerprint") != fingerprints[model_id]:
        raise KVFileError(f"KV of another model (for {model_id!r})")
    try:
        packed = base64.b64decode(str(meta["ids"]), validate=True)
        dense = int(meta["dense_tokens"])
        return KVFileHeader(str(meta["tier"]), str(meta["namespace"]), model_id,
                            str(meta["fingerprint"]), packed, dense)
    except (KeyError, ValueError) as exc:
        raise KVFileError(f"bad metadata: {exc}") from None


def load(folder: TierFolder, rel: str, fingerprints: Mapping[str, str],
         ) -> tuple[KVFileHeader, KVSnapshot | LayeredSnapshot]:
    """The header and the snapshot of the KV file ``rel``, evaluated and checked: its checksum
    over metadata and tensors, then every field against the tensors, before anything is
    restored from it.

    KVFileError if it does not check out; FileNotFoundError if it is gone (another process
    evicted it); another OSError if a link or a FIFO stands in its place (``TierFolder.open``)."""
    with folder.open(rel) as fh:
        try:
            loaded = mx.load(fh, format="safetensors", return_metadata=True)
            arrays, meta = cast(tuple[dict[str, mx.array], dict[str, str]], loaded)
            mx.eval(arrays)
        except (RuntimeError, ValueError) as exc:   # mlx's words for truncated, corrupt files
            raise KVFileError(f"unreadable: {exc}") from None
    header = check_header(meta, fingerprints)
    if meta.get("checksum") != checksum(arrays, meta):
        raise KVFileError("checksum mismatch")
    if meta.get("layers"):
        return header, _layered(header, arrays, meta)
    try:
        layers = tuple((arrays[f"k.{i}"], arrays[f"v.{i}"]) for i in range(len(arrays) // 2))
        n_tokens = int(meta["n_tokens"])
        positions = (tuple(unpack_ids(base64.b64decode(meta["positions"])))
                     if meta["positions"] else None)
        span = int(meta["span"]) if meta["span"] else None
        # The keep share a sparse snapshot was chosen at (none: it serves only its dense part).
        keep_pct = float(meta["keep_pct"]) if meta.get("keep_pct") else None
        reply_from = _reply_from(meta)
    except (KeyError, ValueError) as exc:
        raise KVFileError(f"bad metadata: {exc}") from None
    if (not layers or len(arrays) != 2 * len(layers)
            or any(k.shape[-2] != n_tokens or v.shape[-2] != n_tokens for k, v in layers)):
        raise KVFileError("tensors do not match the metadata")
    nbytes = sum(k.nbytes + v.nbytes for k, v in layers)
    snap = KVSnapshot(layers, n_tokens, nbytes, positions, span, keep_pct, reply_from)
    _check_fields(snap, header)
    return header, snap


def _layered(header: KVFileHeader, arrays: dict[str, mx.array],
             meta: Mapping[str, str]) -> LayeredSnapshot:
    """A layered snapshot's file: every layer whole, as its description says."""
    try:
        snap = layers_from_arrays(arrays, json.loads(meta["layers"]), int(meta["n_tokens"]))
        snap = replace(snap, reply_from=_reply_from(meta))
    except (KeyError, ValueError, TypeError) as exc:
        raise KVFileError(f"bad layers: {exc}") from None
    if meta.get("positions") or meta.get("span") or meta.get("keep_pct"):
        raise KVFileError("a layered snapshot is never sparse")
    _check_fields(snap, header)
    return snap


def _reply_from(meta: Mapping[str, str]) -> int | None:
    """The file's ``reply_from`` (None: no generated ids, or a version 2 file)."""
    value = meta.get("reply_from", "")
    return int(value) if value else None


def _check_fields(snap: KVSnapshot | LayeredSnapshot, header: KVFileHeader) -> None:
    """The fields agree with each other and with the tensors (a second line behind the
    checksum: whatever a file says, it restores only what it holds)."""
    p = snap.positions
    sparse_ok = (p is None and snap.span is None) or (
        p is not None and snap.span is not None and len(p) == snap.n_tokens
        and all(a < b for a, b in zip(p, p[1:], strict=False))
        and (not p or (p[0] >= 0 and p[-1] < snap.span)))
    if (not sparse_ok or len(header.packed_ids) // 4 != snap.prompt_tokens
            or header.dense_tokens != snap.dense_tokens
            or (snap.keep_pct is not None and not 0.0 < snap.keep_pct <= 1.0)
            or (snap.reply_from is not None
                and not 0 < snap.reply_from <= snap.prompt_tokens)):
        raise KVFileError("metadata does not match the tensors")


def model_fingerprint(model: Any) -> str:
    """A fingerprint of a loaded model's weights, every byte (for models built in memory, as
    tests do; a folder's ``folder_fingerprint`` is cheaper for real ones)."""
    from mlx.utils import tree_flatten

    h = xxhash.xxh3_128()
    for name, value in tree_flatten(model.parameters()):
        mx.eval(value)
        h.update(f"{name}\0{value.dtype}\0{value.shape}\0".encode())
        h.update(memoryview(value))
    return h.hexdigest()
