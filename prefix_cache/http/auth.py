"""Reading credentials from an ``Authorization`` header, once for every server."""

from __future__ import annotations

import base64
import binascii
import hmac

from .errors import is_anthropic_path

BEARER_HINT = "'Authorization: Bearer KEY'"
X_API_KEY_HINT = "'x-api-key: KEY' (or 'Authorization: Bearer KEY')"


def key_hint(path: str) -> str:
    """How a 401 tells the caller to send its key: as its API's clients send one (Anthropic's:
    ``x-api-key``; both headers are read on every path)."""
    return X_API_KEY_HINT if is_anthropic_path(path) else BEARER_HINT


def bearer_key(authorization: str | None) -> str | None:
    """The key of an ``Authorization: Bearer KEY`` header, or None."""
    if not authorization:
        return None
    scheme, _, key = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        return None
    return key.strip()


def client_authorization(authorization: str | None, x_api_key: str | None) -> str | None:
    """The ``Authorization`` a /v1 client sent; Anthropic's clients send their key as
    ``x-api-key: KEY`` instead, read as ``Bearer KEY`` when there is no Authorization."""
    if authorization or not x_api_key or not x_api_key.strip():
        return authorization
    return f"Bearer {x_api_key.strip()}"


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
