"""Whether a server can listen where it was told to, asked before it loads anything: a port in
use is found in a second, not after a model has loaded (uvicorn binds only once the app is made)."""

from __future__ import annotations

import socket


def check_can_listen(host: str, port: int) -> None:
    """Bind ``host:port`` as uvicorn will (``SO_REUSEADDR``, so a port left in TIME_WAIT passes)
    and let it go; OSError naming the address when that fails. Port 0 (any free port) passes.
    Another process may still take the port before the server binds: uvicorn then says so."""
    if port == 0:
        return
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise OSError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            raise OSError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
