"""A throwaway PostgreSQL server for tests and benchmarks: a real ``postgres`` on a free
loopback port, its data and socket in a temporary folder, gone when it stops.

PostgreSQL refuses to run as root. Run as root (a container), the server and ``initdb``
run as ``nobody``, which owns the folder; otherwise as the caller. The superuser
``agl`` has a password (scram-sha-256 over TCP), so the gateway's password path is the
one tested. ``fsync=off``: the tests kill gateway processes, never the server, and a
commit acknowledged by the server survives a client's death without an fsync; a store's
own durability setting (``synchronous_commit``) is what they exercise.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from agl.core.ports import free_port

USER = "agl"
PASSWORD = "agl-test-password"  # a throwaway server's, on loopback


def binaries() -> Path:
    """The folder of ``initdb`` and ``postgres``: on PATH, else Debian's newest."""
    found = shutil.which("initdb")
    if found and shutil.which("postgres"):
        return Path(found).resolve().parent
    versions = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"))
    if not versions:
        raise FileNotFoundError(
            "PostgreSQL's initdb is not installed (Debian: apt-get install postgresql)"
        )
    return versions[-1].parent


@dataclass
class PostgresServer:
    host: str
    port: int
    folder: Path
    process: subprocess.Popen[bytes]

    def url(self, database: str = "postgres") -> str:
        """The store URL of ``database``: no password (it goes by $AGL_STORE_PASSWORD)."""
        return f"postgresql://{USER}@{self.host}:{self.port}/{database}"

    def create_database(self, name: str | None = None) -> str:
        """A new empty database; answers its store URL."""
        name = name or f"t_{uuid.uuid4().hex[:16]}"
        subprocess.run(
            [str(binaries() / "createdb"), "-h", self.host, "-p", str(self.port), "-U", USER, name],
            check=True,
            capture_output=True,
            env={**os.environ, "PGPASSWORD": PASSWORD},
        )
        return self.url(name)


def _as_server_user() -> dict[str, object]:
    """Popen's arguments that drop root to ``nobody`` (PostgreSQL refuses root)."""
    if os.geteuid() != 0:
        return {}
    return {"user": "nobody", "group": "nogroup", "extra_groups": []}


@contextmanager
def postgres_server(timeout_s: float = 60.0) -> Iterator[PostgresServer]:
    """A fresh server on a free loopback port, stopped (and its folder removed) on exit."""
    bin_dir = binaries()
    folder = Path(tempfile.mkdtemp(prefix="agl-pg-"))
    drop = _as_server_user()
    if drop:
        shutil.chown(folder, "nobody", "nogroup")
    data, password_file = folder / "data", folder / "password"
    password_file.write_text(PASSWORD)
    if drop:
        shutil.chown(password_file, "nobody", "nogroup")
    subprocess.run(
        [
            str(bin_dir / "initdb"),
            "-D",
            str(data),
            "-U",
            USER,
            f"--pwfile={password_file}",
            "--auth=scram-sha-256",
            "--encoding=UTF8",
            "--no-sync",
        ],
        check=True,
        capture_output=True,
        **drop,  # type: ignore[call-overload]
    )
    password_file.unlink()
    port = free_port()
    process = subprocess.Popen(
        [
            str(bin_dir / "postgres"),
            "-D",
            str(data),
            "-p",
            str(port),
            "-k",
            str(folder),
            "-c",
            "listen_addresses=127.0.0.1",
            "-c",
            "fsync=off",
            "-c",
            "max_connections=200",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        **drop,  # type: ignore[call-overload]
    )
    server = PostgresServer("127.0.0.1", port, folder, process)
    try:
        _wait_ready(server, bin_dir, timeout_s)
        yield server
    finally:
        if process.poll() is None:
            process.terminate()  # smart shutdown: no client is left by then
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)
        shutil.rmtree(folder, ignore_errors=True)


def _wait_ready(server: PostgresServer, bin_dir: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"postgres exited with {server.process.returncode} at start")
        ready = subprocess.run(
            [str(bin_dir / "pg_isready"), "-h", server.host, "-p", str(server.port)],
            capture_output=True,
        )
        if ready.returncode == 0:
            return
        time.sleep(0.1)
    raise TimeoutError(f"postgres on port {server.port} not ready after {timeout_s} s")
