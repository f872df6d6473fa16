"""The gateway's store: the interface (``base``), its SQLite implementation (``sqlite``,
embedded, one process), its PostgreSQL one (``postgresql``, shared by replicas) and the
rollout state machine every store applies (``lifecycle``)."""

from __future__ import annotations

from pathlib import Path

from agl.core.gateway.store.base import SharedStore, Store
from agl.core.gateway.store.sqlite import SqliteStore

__all__ = ["SharedStore", "SqliteStore", "Store", "open_store"]

POSTGRES_SCHEMES = ("postgresql://", "postgres://")


def open_store(
    url: str, fsync: bool = False, password_file: str = "", lease_s: float = 5.0
) -> Store:
    """A store from a URL: ``sqlite:///path/to/file.db`` or a plain file path (embedded,
    one process); ``postgresql://user@host:port/db`` (or ``postgres://``), shared by
    several gateway processes, its password from ``password_file`` or
    ``$AGL_STORE_PASSWORD``, never the URL. ``fsync`` makes each SQLite commit survive
    the loss of the machine, not only of the process (PostgreSQL's commits always wait
    for the server's WAL flush). ``lease_s``: how long a silent replica counts as alive.
    Await the store's ``connect()`` before its first call."""
    if url.startswith(POSTGRES_SCHEMES):
        # Imported here: asyncpg is the optional ``postgresql`` extra.
        from agl.core.gateway.store.postgresql import PostgresStore

        return PostgresStore(url, password_file=password_file, lease_s=lease_s)
    if url.startswith("sqlite://"):
        path = url.removeprefix("sqlite://")
    elif "://" in url:
        raise ValueError(
            f"unsupported store URL {url!r}: use sqlite:///path, a file path, or "
            "postgresql://user@host:port/db"
        )
    else:
        path = url
    return SqliteStore(Path(path), fsync=fsync)
