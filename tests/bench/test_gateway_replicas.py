"""``bench/gateway_replicas.py`` in miniature: every setup (SQLite, PostgreSQL with one
and with two replicas) answers every call and event, and the database's counters charge
each workload what its calls write: at least one commit and one row per call, the same
per call whether one replica or two serve the agents."""

from __future__ import annotations

import pytest

from agl.testing.postgres import binaries
from bench.gateway_replicas import SETUPS, measure, measured_table, paper_table


@pytest.mark.timeout(120)
def test_every_setup_serves_its_agents_and_the_writes_per_call_do_not_depend_on_replicas() -> None:
    try:
        binaries()
    except FileNotFoundError as error:
        pytest.skip(str(error))  # tests/run installs it
    rows = measure(agents=4, seconds=0.3)
    assert [(r.setup, r.workload) for r in rows] == [
        (s, w) for s in SETUPS for w in ("chat", "events")
    ]
    for row in rows:
        assert row.result.calls > 0 and row.result.errors == 0, row
        assert row.gateway_cpu_ms > 0, row
        if not row.setup.postgres:
            assert row.writes is None and row.server_cpu_ms is None
            continue
        assert row.writes is not None and row.writes.events > row.result.calls, row
        assert row.xacts_per_call is not None and row.xacts_per_call >= 1, row
        assert row.rows_per_call is not None and row.rows_per_call >= 1, row
    one, two = ({r.workload: r for r in rows if r.setup == setup} for setup in SETUPS[1:])
    for workload in ("chat", "events"):
        # What a call writes is the store's work, not the replica count's: the same
        # rows, and commits within a heartbeat's few over a tiny run.
        assert one[workload].rows_per_call == pytest.approx(two[workload].rows_per_call, abs=0.1)
        assert one[workload].xacts_per_call == pytest.approx(two[workload].xacts_per_call, abs=0.5)
    report = measured_table(rows, 4, 0.3) + paper_table(rows)
    assert "PostgreSQL, 2 replicas" in report and "replicas fed" in report
