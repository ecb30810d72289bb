"""One KV snapshot as one safetensors file: what is written, how it is read back and checked.

    tensors   k.<layer>, v.<layer>                    (the snapshot's keys and values)
    metadata  format, version, tier, namespace, model_id, fingerprint (the weights and config
              the KV came from), ids (the packed prefix ids, base64), n_tokens, positions,
              span and keep_pct (sparse snapshots), checksum (xxh3_64 of the tensors' bytes)

Everything a lookup needs before it reads any KV is in the header (``read_header`` reads only
that), so the startup scan costs one small read per file. A file that does not check out on
every point raises ``KVFileError``; its caller deletes it and the KV is computed again.
"""

from __future__ import annotations

import base64
import json
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import xxhash

from prefix_cache.token_ids import pack_ids, unpack_ids

from .kv_cache import KVSnapshot

FORMAT = "prefix-cache-kv"
VERSION = 1
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


def _checksum(arrays: Mapping[str, mx.array]) -> str:
    h = xxhash.xxh3_64()
    for name in sorted(arrays):
        h.update(name.encode())
        h.update(memoryview(arrays[name]))
    return h.hexdigest()


def encode(snap: KVSnapshot, *, tier: str, namespace: str, model_id: str, fingerprint: str,
           packed_ids: bytes) -> tuple[dict[str, mx.array], dict[str, str]]:
    """The tensors and metadata of a snapshot's file."""
    arrays: dict[str, mx.array] = {}
    for i, (k, v) in enumerate(snap.layers):
        arrays[f"k.{i}"], arrays[f"v.{i}"] = k, v
    meta = {"format": FORMAT, "version": str(VERSION), "tier": tier, "namespace": namespace,
            "model_id": model_id, "fingerprint": fingerprint, "ids": _b64(packed_ids),
            "n_tokens": str(snap.n_tokens), "dense_tokens": str(snap.dense_tokens),
            "positions": "" if snap.positions is None else _b64(pack_ids(snap.positions)),
            "span": "" if snap.span is None else str(snap.span),
            "keep_pct": "" if snap.keep_pct is None else repr(snap.keep_pct),
            "checksum": _checksum(arrays)}
    return arrays, meta


def write(path: Path, arrays: Mapping[str, mx.array], meta: Mapping[str, str]) -> None:
    """Write a KV file crash-safely: a private temporary name (mode 0600: it holds what a tenant
    sent), fsync, rename over ``path``, fsync of the folder. Readers see the old file or the
    whole new one, never a part."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.{os.urandom(4).hex()}.tmp{SUFFIX}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as fh:
            mx.save_safetensors(fh, dict(arrays), metadata=dict(meta))
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def read_header(path: Path) -> dict[str, str]:
    """The metadata of a safetensors file, read without its tensors."""
    with open(path, "rb") as fh:
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
    if meta.get("format") != FORMAT or meta.get("version") != str(VERSION):
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


def load(path: Path, fingerprints: Mapping[str, str]) -> tuple[KVFileHeader, KVSnapshot]:
    """The header and the snapshot of a KV file, evaluated and checked against its checksum.

    KVFileError if it does not check out; OSError if it is gone (another process evicted it)."""
    if not path.exists():
        raise FileNotFoundError(path)
    try:
        arrays, meta = mx.load(str(path), return_metadata=True)  # type: ignore[misc]
        mx.eval(arrays)
    except (RuntimeError, ValueError) as exc:   # mlx's words for truncated and corrupt files
        if not path.exists():
            raise FileNotFoundError(path) from exc
        raise KVFileError(f"unreadable: {exc}") from None
    header = check_header(meta, fingerprints)
    if meta.get("checksum") != _checksum(arrays):
        raise KVFileError("checksum mismatch")
    try:
        layers = tuple((arrays[f"k.{i}"], arrays[f"v.{i}"]) for i in range(len(arrays) // 2))
        n_tokens = int(meta["n_tokens"])
        positions = (tuple(unpack_ids(base64.b64decode(meta["positions"])))
                     if meta["positions"] else None)
        span = int(meta["span"]) if meta["span"] else None
        # The keep share a sparse snapshot was chosen at (none: it serves only its dense part).
        keep_pct = float(meta["keep_pct"]) if meta.get("keep_pct") else None
    except (KeyError, ValueError) as exc:
        raise KVFileError(f"bad metadata: {exc}") from None
    if (not layers or len(arrays) != 2 * len(layers)
            or any(k.shape[-2] != n_tokens or v.shape[-2] != n_tokens for k, v in layers)
            or (positions is not None and len(positions) != n_tokens)):
        raise KVFileError("tensors do not match the metadata")
    nbytes = sum(k.nbytes + v.nbytes for k, v in layers)
    return header, KVSnapshot(layers, n_tokens, nbytes, positions, span, keep_pct)


def folder_fingerprint(folder: str | Path, sample_bytes: int = 1 << 20) -> str:
    """A fingerprint of a model folder's weights and config: config.json whole, and of each
    weight file its name, size, header (tensor names, dtypes, shapes, offsets) and three
    samples of its data (start, middle, end). Reading every byte of a 16 GB model at each start
    would cost seconds; a retrained or requantized model changes its header or its samples."""
    root = Path(folder)
    h = xxhash.xxh3_128()
    config = root / "config.json"
    h.update(config.read_bytes() if config.is_file() else b"")
    for weights in sorted(root.glob("*.safetensors")):
        size = weights.stat().st_size
        h.update(f"{weights.name}\0{size}\0".encode())
        with open(weights, "rb") as fh:
            for at in (0, max(0, size // 2 - sample_bytes // 2), max(0, size - sample_bytes)):
                fh.seek(at)
                h.update(fh.read(sample_bytes))
    return h.hexdigest()


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
