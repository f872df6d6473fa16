"""``python -m experiments.swe.pytest_server``: pytest kept warm, one forked run a request.

A fresh ``python -m pytest`` costs ~0.45 s of start-up before the first test here (the
interpreter, pytest and its plugins), more than most of the projects' whole suites. This
process imports pytest once and then, for each request read from stdin (one JSON object
a line: ``cwd``, ``args``, ``pythonpath``, ``timeout``), forks a child that changes into
``cwd`` and runs ``pytest.main`` there; the child reports each test's outcome through a
pipe and exits, so nothing the tests imported (the project, the agent's code) outlives
the run or leaks into the next. A child that runs past ``timeout`` (a bug that loops) is
killed with its process group. One JSON line answers each request: ``outcomes`` (node id
to ``passed``, ``failed``, ``error`` or ``skipped``), ``messages`` (a failure's first
line), ``timed_out``, ``exit`` and the output's tail.

No bytecode is written: a ``.pyc`` of the unbugged module, left beside a same-size edit
made within the same second, would be loaded instead of the source.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import select
import signal
import sys
import tempfile
import time
from typing import Any

import pytest

OUTPUT_TAIL = 4000
# Python's own tracebacks in the output (a project's arguments may ask for others): pytest's
# long ones parse each module on a failure's path with ``ast`` again for every failure,
# most of a run's time when a bug fails dozens of tests (schema: ~6 s of a 7 s run). The
# outcomes and each failure's first line are the same in any style.
TRACEBACKS = ("--tb=native",)


MESSAGE_CHARS = 300


class _Outcomes:
    """A pytest plugin: each test's outcome, a failed phase winning over a passed one,
    and the first line of each failure's message."""

    def __init__(self) -> None:
        self.outcomes: dict[str, str] = {}
        self.messages: dict[str, str] = {}

    def pytest_runtest_logreport(self, report: Any) -> None:
        if report.when == "call" or report.outcome != "passed":
            outcome = report.outcome
            if report.when != "call" and outcome == "failed":
                outcome = "error"  # setup or teardown failed
            if self.outcomes.get(report.nodeid) in ("failed", "error"):
                return
            self.outcomes[report.nodeid] = outcome
            crash = getattr(report.longrepr, "reprcrash", None)
            if outcome in ("failed", "error") and crash is not None:
                first = (crash.message or "").strip().splitlines()
                self.messages[report.nodeid] = first[0][:MESSAGE_CHARS] if first else ""

    def pytest_collectreport(self, report: Any) -> None:
        if report.failed:
            self.outcomes[report.nodeid or "<collection>"] = "error"


def _child(request: dict[str, Any], write_fd: int, log_path: str) -> None:
    os.setpgid(0, 0)
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.chdir(request["cwd"])
    for entry in reversed(request.get("pythonpath") or []):
        sys.path.insert(0, os.path.join(request["cwd"], entry))
    plugin = _Outcomes()
    code = pytest.main(["-p", "no:cacheprovider", *TRACEBACKS, *request["args"]], plugins=[plugin])
    with os.fdopen(write_fd, "w") as out:
        json.dump(
            {"outcomes": plugin.outcomes, "messages": plugin.messages, "exit": int(code)}, out
        )
    sys.stdout.flush()
    os._exit(0)


def _read_all(fd: int, deadline: float) -> tuple[bytes, bool]:
    chunks = []
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return b"".join(chunks), False
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            return b"".join(chunks), True
        chunks.append(chunk)


def _tail(path: str) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - OUTPUT_TAIL))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def serve_one(request: dict[str, Any]) -> dict[str, Any]:
    read_fd, write_fd = os.pipe()
    log_path = os.path.join(tempfile.gettempdir(), f"agl-pytest-{os.getpid()}.log")
    pid = os.fork()
    if pid == 0:
        os.close(read_fd)
        try:
            _child(request, write_fd, log_path)
        finally:
            os._exit(70)
    os.close(write_fd)
    started = time.monotonic()
    data, finished = _read_all(read_fd, started + float(request.get("timeout", 60)))
    os.close(read_fd)
    if not finished:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
    # a child that closed its pipe and went on running is killed at the deadline too
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > started + float(request.get("timeout", 60)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            finished = False
            break
        time.sleep(0.01)
    answer: dict[str, Any] = {"outcomes": {}, "exit": None, "timed_out": not finished}
    if finished and data:
        # a child that died before reporting leaves no outcome: no test counts as passed
        with contextlib.suppress(ValueError):
            answer.update(json.loads(data))
    answer["seconds"] = time.monotonic() - started
    answer["output"] = _tail(log_path)
    with contextlib.suppress(OSError):
        os.unlink(log_path)
    return answer


def _warm() -> None:
    """pytest's own plugins imported here, once, rather than in every child."""
    sink = io.StringIO()
    with (
        tempfile.TemporaryDirectory() as empty,
        contextlib.redirect_stdout(sink),
        contextlib.redirect_stderr(sink),
    ):
        pytest.main(["-q", "-p", "no:cacheprovider", "--collect-only", empty])


def main() -> None:
    sys.dont_write_bytecode = True
    _warm()
    for line in sys.stdin:
        if not line.strip():
            continue
        answer = serve_one(json.loads(line))
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
