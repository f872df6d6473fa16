"""What a test run costs the coding task: a fresh ``python -m pytest`` against the warm,
forked one (``experiments.swe.pytest_server``), on the same projects, alternated in one
run so the machine's load weighs on both alike.

For each project: its whole suite, then a task's handful of tests (FAIL_TO_PASS plus a
few PASS_TO_PASS), each way ``--rounds`` times; wall seconds per run (median) and the
ratio. The sdists come from the same cache as ``python -m experiments.swe.pipeline make``.

    python -m bench.swe_tests --projects isodate,schema,xmltodict --rounds 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from experiments.swe.pipeline import SDISTS
from experiments.swe.projects import Project, fetch_sdist, load_projects, unpack
from experiments.swe.testrun import PytestServer


def _fresh(project: Project, repo: Path, tests: Sequence[str] | None) -> float:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(str(repo / p) for p in project.pythonpath),
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
    }
    args = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider"]
    args += project.pytest_arguments(tests)
    start = time.perf_counter()
    subprocess.run(args, cwd=repo, env=env, capture_output=True, check=False)
    return time.perf_counter() - start


def _warm(server: PytestServer, project: Project, repo: Path, tests: Sequence[str] | None) -> float:
    start = time.perf_counter()
    server.run(repo, project.pytest_arguments(tests), project.pythonpath)
    return time.perf_counter() - start


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.swe_tests", description=__doc__)
    parser.add_argument("--projects", default="isodate,schema,xmltodict")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    known = load_projects()
    print(f"load average at start: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    print(f"{'project':<12} {'what':<8} {'fresh s':>8} {'warm s':>8} {'fresh/warm':>10}")
    with tempfile.TemporaryDirectory() as scratch, PytestServer() as server:
        for name in args.projects.split(","):
            project = known[name]
            repo = Path(scratch) / name
            unpack(fetch_sdist(project, SDISTS), repo)
            whole = server.run(repo, project.pytest_arguments(), project.pythonpath)
            passing = sorted(t for t, o in whole.outcomes.items() if o == "passed")
            few = passing[:: max(1, len(passing) // 8)][:8]
            for what, tests in (("suite", None), ("8 tests", few)):
                fresh, warm = [], []
                for _ in range(args.rounds):
                    fresh.append(_fresh(project, repo, tests))
                    warm.append(_warm(server, project, repo, tests))
                f, w = statistics.median(fresh), statistics.median(warm)
                print(f"{name:<12} {what:<8} {f:>8.3f} {w:>8.3f} {f / w:>10.1f}")
    print(f"load average at end: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
