"""TCP ports and the hosts to reach them at: a free port to bind, whether one is, whether
a number is a port at all. At the bottom of the house, beside ``agl.core.processes``: it
imports nothing of agl's, so the services, the inference backends, the executors and the
test fixtures that start servers share one way to pick a port."""

from __future__ import annotations

import socket


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def port_free(host: str, port: int) -> bool:
    with socket.socket(_family(host)) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(_family(host)) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def connect_host(host: str) -> str:
    """Where to reach a server bound to ``host``: loopback for a wildcard address, an IPv6
    literal in brackets (a URL's form)."""
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


def check_port(port: int) -> None:
    """ValueError unless ``port`` is a TCP port (a config's ``__post_init__`` check)."""
    if not 0 < port < 65536:
        raise ValueError(f"port={port} is not a TCP port (1-65535)")
