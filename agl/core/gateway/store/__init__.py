"""The gateway's store: the interface (``base``), its SQLite implementation (``sqlite``)
and the rollout state machine every store applies (``lifecycle``)."""

from __future__ import annotations

from pathlib import Path

from agl.core.gateway.store.base import Store
from agl.core.gateway.store.sqlite import SqliteStore

__all__ = ["SqliteStore", "Store", "open_store"]


def open_store(url: str, fsync: bool = False) -> Store:
    """A store from a URL: ``sqlite:///path/to/file.db`` or a plain file path. ``fsync``
    makes each commit survive the loss of the machine, not only of the process."""
    if url.startswith("sqlite://"):
        path = url.removeprefix("sqlite://")
    elif "://" in url:
        raise ValueError(f"unsupported store URL {url!r}: use sqlite:///path or a file path")
    else:
        path = url
    return SqliteStore(Path(path), fsync=fsync)
