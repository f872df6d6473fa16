"""HTTP/1.1 over a raw socket to a gateway, for clients that send slowly, too much or
not at all: connect, a request head, everything until the server closes, its status."""

from __future__ import annotations

import socket
import time

import pytest

from agl.testing.processes import GatewayProcess

DEADLINE_S = 60.0  # generous: the server closes well before; a loaded machine is slow


def connect(gateway: GatewayProcess) -> socket.socket:
    host, port = gateway.url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=DEADLINE_S)


def until_closed(sock: socket.socket, deadline: float | None = None) -> bytes:
    """Everything the server sends until it closes the connection (EOF); fails if it has
    not closed it by ``deadline`` (``time.monotonic``'s; default: ``DEADLINE_S`` on)."""
    received = b""
    deadline = time.monotonic() + DEADLINE_S if deadline is None else deadline
    with sock:
        while (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                break
            except ConnectionResetError:
                return received
            if not chunk:
                return received
            received += chunk
    pytest.fail(f"the server still holds the connection past its deadline: {received!r}")


def status(answer: bytes) -> int:
    assert answer.startswith(b"HTTP/1.1 "), answer
    return int(answer.split(b" ", 2)[1])


def head(method: str, path: str, *headers: str) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: gateway", *headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()
