"""The server's sockets: bound here, before anything slow starts, so a taken port or a bad host is
one refusal at once rather than a failure after the model has loaded."""

from __future__ import annotations

import socket

from ster_dist.errors import Refusal


def bound(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port (port 0: a free one), not yet listening."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise Refusal(
            f"cannot listen on {host}:{port}: {exc.strerror or exc}; give another --port (0 picks a "
            "free one) or --host"
        ) from None
    return sock


def listen(host: str, port: int) -> socket.socket:
    """A listening socket on host:port that a child process may inherit (uvicorn serves it)."""
    sock = bound(host, port)
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def check_free(host: str, port: int) -> None:
    """Refuse now when host:port cannot be bound (a server that binds it later would fail
    unseen)."""
    bound(host, port).close()


def free_port(host: str) -> int:
    """A port free on `host` now, for a server that cannot bind port 0 itself (Serve's proxy)."""
    with bound(host, 0) as sock:
        return sock.getsockname()[1]
