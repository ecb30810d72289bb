"""How the disk tier names its files: the key of an entry and its place below the root.

    <tier>/ns-<xxh3_64(namespace)>/<h[:2]>/<h>.safetensors
        h = xxh3_128(tier, namespace, model id, xxh3_128(packed prefix ids))
"""

from __future__ import annotations

from dataclasses import dataclass

import xxhash

from .file import SUFFIX

DiskKey = tuple[str, str, str, bytes]   # tier, namespace, model id, xxh3_128(packed ids)


@dataclass(frozen=True, slots=True)
class DiskEntry:
    """A file the index knows: where it is (below the root) and the prefix ids it holds."""

    rel: str
    packed_ids: bytes
    dense_tokens: int


def disk_key(tier: str, namespace: str, model_id: str, packed_ids: bytes) -> DiskKey:
    return (tier, namespace, model_id, xxhash.xxh3_128_digest(packed_ids))


def namespace_dir(namespace: str) -> str:
    return f"ns-{xxhash.xxh3_64_hexdigest(namespace.encode())}"


def disk_rel(key: DiskKey) -> str:
    """Where a key's file is, below the root."""
    tier, namespace, model_id, digest = key
    h = xxhash.xxh3_128_hexdigest(b"\0".join(
        (tier.encode(), namespace.encode(), model_id.encode(), digest)))
    return f"{tier}/{namespace_dir(namespace)}/{h[:2]}/{h}{SUFFIX}"
