"""Where the suite's time goes: ``python -m tests.helpers.durations [pytest args]`` runs the
suite (``python -m pytest`` with those arguments) and writes ``tests/DURATIONS.md``: wall
time, the machine's load, and the time of each file, each test and each fixture.

As a pytest plugin (``tests/conftest.py`` loads it) it orders the files, longest first
by the table, and records nothing unless
``--durations-json=FOLDER`` is given: then every process of the run (the controller and
each xdist worker) writes its own JSON there, the tests' phases from the controller, the
fixtures' set-ups from the process that ran them.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Generator, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
TABLE = ROOT / "tests" / "DURATIONS.md"
TOP = 40


@dataclass
class Recorder:
    folder: Path
    name: str
    phases: dict[str, dict[str, float]] = field(default_factory=lambda: defaultdict(dict))
    outcomes: dict[str, str] = field(default_factory=dict)
    fixtures: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    def dump(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        data = {"phases": self.phases, "outcomes": self.outcomes, "fixtures": self.fixtures}
        (self.folder / f"{self.name}.json").write_text(json.dumps(data))


_recorder: Recorder | None = None


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--durations-json",
        metavar="FOLDER",
        help="write each test's and each fixture's time there (tests/helpers/durations.py)",
    )


def pytest_configure(config: pytest.Config) -> None:
    global _recorder
    folder = config.getoption("--durations-json")
    if folder:
        worker = getattr(config, "workerinput", {}).get("workerid", "controller")
        _recorder = Recorder(Path(folder), worker)


def pytest_unconfigure(config: pytest.Config) -> None:
    if _recorder is not None:
        _recorder.dump()


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef: pytest.FixtureDef[Any]) -> Generator[None, None, None]:
    start = time.perf_counter()
    yield
    # A parametrize argument is a fixture too, one that takes no time.
    if _recorder is not None and fixturedef.func.__name__ != "get_direct_param_fixture_func":
        where = fixturedef.baseid or "pytest"
        _recorder.fixtures[f"{fixturedef.argname} ({fixturedef.scope}, {where})"] += (
            time.perf_counter() - start
        )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The files that took longest last time first (``TABLE``), each file's tests in their
    own order: under xdist (``tests/run``: ``--dist loadfile``) a worker takes the next
    whole file when it is free, and a long file taken last would run alone."""
    seconds = file_seconds()
    items.sort(key=lambda item: -seconds.get(item.nodeid.split("::")[0], 0.0))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # Under xdist the controller sees every worker's reports; a worker sees its own.
    if _recorder is not None and _recorder.name == "controller":
        _recorder.phases[report.nodeid][report.when] = report.duration
        if report.when == "call" or report.outcome != "passed":
            _recorder.outcomes[report.nodeid] = report.outcome


def file_seconds(path: Path = TABLE) -> dict[str, float]:
    """Each file's seconds in a table this module wrote; empty when there is none."""
    if not path.is_file():
        return {}
    section = path.read_text().split("## By file", 1)[-1].split("\n## ", 1)[0]
    found = re.findall(r"^\|\s*([0-9.]+) \| `([^`]+)` \|$", section, re.M)
    return {name: float(seconds) for seconds, name in found}


def _merge(folder: Path) -> tuple[dict[str, dict[str, float]], dict[str, str], dict[str, float]]:
    phases: dict[str, dict[str, float]] = {}
    outcomes: dict[str, str] = {}
    fixtures: dict[str, float] = defaultdict(float)
    for path in sorted(folder.glob("*.json")):
        data = json.loads(path.read_text())
        phases.update(data["phases"])
        outcomes.update(data["outcomes"])
        for name, seconds in data["fixtures"].items():
            fixtures[name] += seconds
    return phases, outcomes, fixtures


def _rows(pairs: Iterable[tuple[str, float]], limit: int | None = None) -> list[str]:
    ranked = sorted(pairs, key=lambda pair: -pair[1])[:limit]
    return [f"| {seconds:8.1f} | `{name}` |" for name, seconds in ranked]


def table(folder: Path, wall_s: float, command: list[str], load: str) -> str:
    phases, outcomes, fixtures = _merge(folder)
    by_test = {node: sum(times.values()) for node, times in phases.items()}
    by_file: dict[str, float] = defaultdict(float)
    for node, seconds in by_test.items():
        by_file[node.split("::")[0]] += seconds
    counts: dict[str, int] = defaultdict(int)
    for outcome in outcomes.values():
        counts[outcome] += 1
    summary = ", ".join(f"{n} {outcome}" for outcome, n in sorted(counts.items()))
    lines = [
        "# Where the suite's time goes",
        "",
        "Written by `python -m tests.helpers.durations` (its arguments go to pytest); do not",
        "edit by hand. Times are seconds of each test's set-up, call and tear-down as its",
        "process saw them: under xdist the workers overlap, so they add up to more than the",
        "wall time. A module- or session-scoped fixture's set-up is counted once, in the",
        "first test that needed it.",
        "",
        f"- command: `{' '.join(command)}`",
        f"- wall: {wall_s:.0f} s; tests: {summary}",
        f"- machine: {os.cpu_count()} cores; load average before → after: {load}",
        "",
        "## By file",
        "",
        "| seconds | file |",
        "|---:|---|",
        *_rows(by_file.items()),
        "",
        f"## The {TOP} slowest tests",
        "",
        "| seconds | test |",
        "|---:|---|",
        *_rows(by_test.items(), TOP),
        "",
        f"## The {TOP} slowest fixtures (set-up, summed over the processes that built them)",
        "",
        "| seconds | fixture (scope, where) |",
        "|---:|---|",
        *_rows(fixtures.items(), TOP),
        "",
    ]
    return "\n".join(lines)


def _load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def main(args: list[str]) -> int:
    with tempfile.TemporaryDirectory(prefix="agl-durations-") as folder:
        command = [sys.executable, "-m", "pytest", f"--durations-json={folder}", *args]
        shown = ["python", "-m", "pytest", *args]
        before = _load()
        start = time.monotonic()
        status = subprocess.run(command, cwd=ROOT).returncode
        wall_s = time.monotonic() - start
        TABLE.write_text(table(Path(folder), wall_s, shown, f"{before} → {_load()}"))
    print(f"durations: {TABLE.relative_to(ROOT)} written ({wall_s:.0f} s)", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
