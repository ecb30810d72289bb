"""Reading credentials from an ``Authorization`` header, once for every server."""

from __future__ import annotations

import base64
import binascii
import hmac


def bearer_key(authorization: str | None) -> str | None:
    """The key of an ``Authorization: Bearer KEY`` header, or None."""
    if not authorization:
        return None
    scheme, _, key = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        return None
    return key.strip()


def basic_password(authorization: str | None) -> str | None:
    """The password of an ``Authorization: Basic ...`` header (what a browser's login prompt
    sends), or None."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        decoded = base64.b64decode(token.strip(), validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        return None
    _, sep, password = decoded.partition(":")
    return password if sep and password else None


def bearer_matches(authorization: str | None, expected: str) -> bool:
    """Whether the header carries exactly ``expected`` as its Bearer key (constant time)."""
    key = bearer_key(authorization)
    return key is not None and hmac.compare_digest(key.encode(), expected.encode())
