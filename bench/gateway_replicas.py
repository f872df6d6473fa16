"""Gateway replicas over PostgreSQL beside one process over SQLite, and their scaling on paper.

One run, one fake vLLM-shaped upstream, one throwaway PostgreSQL server
(``agl.testing.postgres``), real gateway processes, ``bench.gateway``'s load loop. Rows:

- SQLite, 1 process: the default, embedded store (the one-process figure);
- PostgreSQL, 1 replica; PostgreSQL, 2 replicas (the agents split across them).

Each row prints proxied chat calls/s and event POSTs/s, the gateway's CPU per call (summed
over its replicas), the PostgreSQL server's CPU per call (all its processes, from /proc)
and the store's transactions and rows written per call (``pg_stat_database``).

The database's counters are exact, not sampled: a backend publishes its counts at most
once a second, and all of them when it exits. So each workload runs in a gateway lifetime
of its own (start, load, stop, wait until the database has no client left) and is
charged the counters' change over that lifetime, less an idle lifetime's (a start and a
stop alone), divided by the events the lifetime stored (warm-up calls included). The
CPU columns cover the measured seconds only.

On 2 cores the replicas cannot run faster than one process: the client, the upstream,
the gateways and the database share the cores. So the last table puts the measured CPU
per call on paper: a replica is one event loop (one core), the database's processes
spread over its cores.

    python -m bench.gateway_replicas                  # 16 agents, 5 s per workload
    python -m bench.gateway_replicas --seconds 4 --agents 32
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import psutil

from agl.core.ports import free_port
from agl.testing.postgres import PASSWORD, PostgresServer, postgres_server
from agl.testing.processes import GatewayProcess, gateway_process
from bench.gateway import Result, Target, agl_targets, fake_upstream, load, titled

# Calls before the measured seconds: connections opened, caches and the pool warm.
WARMUP_S = 0.5
# The database server of the paper's last column.
PAPER_DB_CORES = 16


@dataclass(frozen=True)
class Setup:
    name: str
    replicas: int
    postgres: bool


SETUPS = (
    Setup("SQLite, 1 process", 1, False),
    Setup("PostgreSQL, 1 replica", 1, True),
    Setup("PostgreSQL, 2 replicas", 2, True),
)


@dataclass(frozen=True)
class Counts:
    """A database's cumulative counters, and the events its store holds."""

    xacts: int  # pg_stat_database.xact_commit
    rows: int  # tup_inserted + tup_updated + tup_deleted
    events: int

    def __sub__(self, other: Counts) -> Counts:
        return Counts(self.xacts - other.xacts, self.rows - other.rows, self.events - other.events)


@dataclass(frozen=True)
class Row:
    """One workload (``chat`` or ``events``) on one setup. Per-call figures divide by
    the calls measured (CPU) or by the events the lifetime stored (the database's)."""

    setup: Setup
    workload: str
    result: Result
    gateway_cpu_ms: float  # per call, every replica's CPU summed
    server_cpu_ms: float | None  # per call, every PostgreSQL process's CPU summed
    writes: Counts | None  # the workload's lifetime, less an idle lifetime's

    @property
    def xacts_per_call(self) -> float | None:
        return None if self.writes is None else self.writes.xacts / self.writes.events

    @property
    def rows_per_call(self) -> float | None:
        return None if self.writes is None else self.writes.rows / self.writes.events


def cpu_by_pid(roots: list[int]) -> dict[int, float]:
    """User + system CPU seconds of each process under ``roots``, the roots included."""
    seconds: dict[int, float] = {}
    for root in roots:
        with contextlib.suppress(psutil.NoSuchProcess):
            top = psutil.Process(root)
            for process in [top, *top.children(recursive=True)]:
                with contextlib.suppress(psutil.NoSuchProcess):
                    times = process.cpu_times()
                    seconds[process.pid] = times.user + times.system
    return seconds


def cpu_spent(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU seconds spent between two readings; a process born between them counts from
    zero (a pool's new connection), one gone since is lost (none is, in a steady load)."""
    return sum(t - before.get(pid, 0.0) for pid, t in after.items())


async def read_counts(url: str) -> Counts:
    """The counters once every client backend of the database has exited (and so
    published its counts): our own connection's count in the next reading, alike in
    every lifetime, so it cancels against the idle lifetime's."""
    db = await asyncpg.connect(url, password=PASSWORD)
    try:
        while await db.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND backend_type = 'client backend' AND pid <> pg_backend_pid()"
        ):
            await asyncio.sleep(0.02)
        stats = await db.fetchrow(
            "SELECT xact_commit, tup_inserted + tup_updated + tup_deleted AS rows"
            " FROM pg_stat_database WHERE datname = current_database()"
        )
        events = await db.fetchval("SELECT count(*) FROM events")
    finally:
        await db.close()
    assert stats is not None
    return Counts(int(stats["xact_commit"]), int(stats["rows"]), int(events))


class Gateways:
    """A setup's gateway processes, started and stopped as often as the counters need:
    the same ports, folders and store each time, so the agents' URLs and keys hold."""

    def __init__(self, setup: Setup, folder: Path, server: PostgresServer) -> None:
        self.setup = setup
        self.options: dict[str, Any] = {"attempt_rps": 0}  # each agent flat out
        self.url: str | None = None
        if setup.postgres:
            secret = folder / "store-password"
            secret.write_text(PASSWORD)
            self.url = server.create_database()
            self.options |= {"store": self.url, "store_password_file": secret}
        self.ports = [free_port() for _ in range(setup.replicas)]
        self.dirs = [folder / f"replica{i}" for i in range(setup.replicas)]

    @contextlib.contextmanager
    def running(self) -> Iterator[list[GatewayProcess]]:
        with contextlib.ExitStack() as stack:
            yield [
                stack.enter_context(gateway_process(d, port=p, **self.options))
                for d, p in zip(self.dirs, self.ports, strict=True)
            ]

    def counts(self) -> Counts | None:
        return None if self.url is None else asyncio.run(read_counts(self.url))


def spread(target: Target, gateways: list[GatewayProcess]) -> Target:
    """``target``'s agents split round-robin over the gateways (made on the first)."""
    first = gateways[0].url
    urls = [
        url.replace(first, gateways[i % len(gateways)].url, 1) for i, url in enumerate(target.urls)
    ]
    return dataclasses.replace(target, urls=urls, pid=None)


def drive(
    target: Target, gateways: list[GatewayProcess], server_pid: int, agents: int, seconds: float
) -> tuple[Result, float, float]:
    """A warm-up, then ``seconds`` measured: the result and the CPU seconds the
    gateways and the database server spent in those seconds."""
    asyncio.run(load(target, agents, WARMUP_S, warmup_s=0))
    pids = [g.process.pid for g in gateways]
    gw_before, db_before = cpu_by_pid(pids), cpu_by_pid([server_pid])
    result = asyncio.run(load(target, agents, seconds, warmup_s=0))
    gw = cpu_spent(gw_before, cpu_by_pid(pids))
    db = cpu_spent(db_before, cpu_by_pid([server_pid]))
    return result, gw, db


def measure_setup(
    setup: Setup,
    folder: Path,
    server: PostgresServer,
    upstream: str,
    agents: int,
    seconds: float,
) -> list[Row]:
    """Lifetimes: one makes the rollouts, an idle one (PostgreSQL only) prices a start
    and a stop, then one per workload, so each workload's counters are its own."""
    gateways = Gateways(setup, folder, server)
    with gateways.running() as started:
        first = started[0]
        targets = agl_targets(first.url, first.token, upstream, first.process.pid, agents)
    before = gateways.counts()
    idle: Counts | None = None
    if before is not None:
        with gateways.running():
            pass
        after = gateways.counts()
        assert after is not None
        idle, before = after - before, after
    rows = []
    for workload, target in zip(("chat", "events"), targets, strict=True):
        with gateways.running() as started:
            result, gw_cpu, db_cpu = drive(
                spread(target, started), started, server.process.pid, agents, seconds
            )
        writes: Counts | None = None
        after = gateways.counts()
        if after is not None and before is not None and idle is not None:
            writes, before = after - before - idle, after
        per_call = 1000 / max(result.calls, 1)
        rows.append(
            Row(
                setup,
                workload,
                result,
                gw_cpu * per_call,
                db_cpu * per_call if setup.postgres else None,
                writes,
            )
        )
    return rows


def measure(agents: int, seconds: float) -> list[Row]:
    """Every setup's chat and event rows, on one upstream and one database server."""
    with (
        tempfile.TemporaryDirectory() as tmp,
        fake_upstream() as (upstream, _),
        postgres_server() as server,
    ):
        rows: list[Row] = []
        for i, setup in enumerate(SETUPS):
            folder = Path(tmp) / f"setup{i}"
            folder.mkdir()
            rows += measure_setup(setup, folder, server, upstream, agents, seconds)
        return rows


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def measured_table(rows: list[Row], agents: int, seconds: float) -> str:
    lines = []
    for row in rows:
        r = row.result
        lines.append(
            [
                row.setup.name,
                row.workload,
                f"{r.rate:.0f}",
                f"{r.pct(0.5):.2f}",
                _fmt(row.gateway_cpu_ms),
                _fmt(row.server_cpu_ms),
                _fmt(row.xacts_per_call),
                _fmt(row.rows_per_call),
                str(r.errors),
            ]
        )
    return titled(
        f"Measured ({agents} agents, {seconds:g} s per workload, {os.cpu_count()} cores "
        "shared by client, upstream, gateways and database; per call = per chat call or "
        "per event POST; gateway CPU summed over replicas)",
        [
            "store",
            "workload",
            "calls/s",
            "p50 ms",
            "gateway CPU ms",
            "PostgreSQL CPU ms",
            "commits",
            "rows written",
            "errors",
        ],
        lines,
    )


def paper_table(rows: list[Row]) -> str:
    """From CPU per call to capacity: a replica is one event loop, so one core serves
    1000 / (its CPU ms per call) calls/s; the database's processes spread over its cores,
    one core serving 1000 / (its CPU ms per call)."""
    lines = []
    for row in rows:
        replica = 1000 / row.gateway_cpu_ms
        if row.server_cpu_ms is None or row.xacts_per_call is None:
            lines.append([row.setup.name, row.workload, f"{replica:.0f}", "-", "-", "-", "-"])
            continue
        db = PAPER_DB_CORES * 1000 / row.server_cpu_ms
        lines.append(
            [
                row.setup.name,
                row.workload,
                f"{replica:.0f}",
                f"{db / PAPER_DB_CORES:.0f}",
                f"{db:.0f}",
                f"{db / replica:.1f}",
                f"{db * row.xacts_per_call:.0f}",
            ]
        )
    n = PAPER_DB_CORES
    return titled(
        "On paper, from the CPU per call measured above (CPU only: no network, no disk;"
        " a real server's commits also wait on its WAL's fsync, this one runs fsync=off)\n"
        "  per replica = 1000 / gateway CPU ms per call (a replica is one event loop, one"
        " core; SQLite's store runs inside its one process, so that row is the whole of it)\n"
        f"  per DB core = 1000 / PostgreSQL CPU ms per call;  {n}-core DB = {n} x per DB core\n"
        f"  replicas fed = {n}-core DB / per replica;  commits/s = {n}-core DB x commits per call",
        [
            "store",
            "workload",
            "per replica /s",
            "per DB core /s",
            f"{n}-core DB /s",
            "replicas fed",
            "commits/s",
        ],
        lines,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--agents", type=int, default=16)
    args = parser.parse_args()
    started = time.perf_counter()
    rows = measure(args.agents, args.seconds)
    print(measured_table(rows, args.agents, args.seconds))
    print(paper_table(rows))
    load_1, load_5, _ = os.getloadavg()
    print(
        f"\n{time.perf_counter() - started:.0f} s in all; load average at the end: "
        f"{load_1:.2f} (1 min), {load_5:.2f} (5 min)"
    )


if __name__ == "__main__":
    main()
