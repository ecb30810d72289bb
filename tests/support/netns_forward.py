"""Loopback only, for the real agent clients: a client runs in a network namespace of its own
(``unshare -n``: only ``lo``, no route anywhere), and one TCP port there is forwarded, over a
Unix socket (a file: it crosses network namespaces), to the sidecar on the host's loopback.

Inside the namespace, as a script (no imports from this repository):
``unshare -n python netns_forward.py PORT SOCKET -- CLIENT ARGS...`` brings ``lo`` up, proves
that nothing beyond it answers (prints ``netns: isolated``), listens on 127.0.0.1:PORT,
forwards each connection to SOCKET, runs the client and exits with its status.
On the host, ``UnixToTcp(SOCKET, port)`` forwards that socket to 127.0.0.1:port.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable

CHUNK = 1 << 16
PROBES = (("1.1.1.1", 443), ("8.8.8.8", 53), ("2606:4700::1111", 443))


def _pump(src: socket.socket, dst: socket.socket) -> None:
    """Copy src to dst until src ends, then end dst's writing side."""
    try:
        while data := src.recv(CHUNK):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)


def _splice(a: socket.socket, b: socket.socket) -> None:
    back = threading.Thread(target=_pump, args=(b, a), daemon=True)
    back.start()
    _pump(a, b)
    back.join()
    a.close()
    b.close()


def serve(listener: socket.socket, connect: Callable[[], socket.socket]) -> None:
    """Accept on ``listener`` forever; splice each connection to a new ``connect()``."""
    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            return  # the listener was closed
        try:
            peer = connect()
        except OSError:
            conn.close()
            continue
        for s in (conn, peer):
            if s.family != socket.AF_UNIX:
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=_splice, args=(conn, peer), daemon=True).start()


class UnixToTcp:
    """The host's end: a Unix socket at ``path`` forwarded to 127.0.0.1:``port``."""

    def __init__(self, path: str, port: int) -> None:
        self.path, self.port = path, port
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(64)
        threading.Thread(target=serve, args=(self.listener, self._connect),
                         daemon=True).start()

    def _connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port))

    def close(self) -> None:
        self.listener.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def isolated() -> bool:
    """True when no address beyond loopback can be reached from here."""
    for host, port in PROBES:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.settimeout(2.0)
            try:
                s.connect((host, port))
            except OSError:
                continue
            return False
    return True


def main(argv: list[str]) -> int:
    port, path, sep, *command = argv
    assert sep == "--" and command, "usage: netns_forward.py PORT SOCKET -- CLIENT ARGS..."
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    if not isolated():
        print("netns: NOT isolated: an address beyond loopback answered", file=sys.stderr)
        return 97
    print("netns: isolated", file=sys.stderr, flush=True)
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", int(port)))
    listener.listen(64)

    def connect() -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(path)
        return s

    threading.Thread(target=serve, args=(listener, connect), daemon=True).start()
    return subprocess.run(command).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
