"""Fixtures of the gateway's tests."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path

import pytest

from agl.core.gateway.store import Store, open_store
from agl.testing.postgres import PASSWORD, PostgresServer, binaries, postgres_server

OpenStore = Callable[[], AbstractAsyncContextManager[Store]]


@asynccontextmanager
async def _opened(url: str) -> AsyncIterator[Store]:
    store = open_store(url)
    await store.connect()
    try:
        yield store
    finally:
        await store.close()


def _sqlite(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'store.db'}"


def _postgresql(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    server: PostgresServer = request.getfixturevalue("postgres")
    request.getfixturevalue("monkeypatch").setenv("AGL_STORE_PASSWORD", PASSWORD)
    return server.create_database()


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    """A real PostgreSQL server for this session (one per xdist worker); each test that
    needs one makes a database of its own on it (``create_database``)."""
    try:
        binaries()
    except FileNotFoundError as error:
        pytest.skip(str(error))  # tests/run installs it
    with postgres_server() as server:
        yield server


# A store URL of each kind, on a database of the test's own (a kind's server, if it
# needs one, is a fixture of its own: request.getfixturevalue).
_DATABASES: dict[str, Callable[[pytest.FixtureRequest, Path], str]] = {
    "sqlite": _sqlite,
    "postgresql": _postgresql,
}


@pytest.fixture(params=sorted(_DATABASES))
def any_store(request: pytest.FixtureRequest, tmp_path: Path) -> OpenStore:
    """Opens a store of each kind the gateway runs on, on a fresh database of the test's
    own: ``async with any_store() as store``, inside the test's event loop (a store's
    connections may belong to the loop that opened them). Each call opens the same
    database again, so a second one reads what the first stored, as a restarted gateway
    would. Tests written against it use the Store interface only."""
    url = _DATABASES[request.param](request, tmp_path)
    return lambda: _opened(url)
