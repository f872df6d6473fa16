"""Running a task's tests: a warm pytest process (``experiments.swe.pytest_server``) and
the verdict SWE-smith's grading gives from its outcomes.

``PytestServer`` starts the server (under a command prefix: the sandbox's, when the
tests run the agent's code), sends it one run at a time and starts it again if it died
(a test may kill its parent); ``verdict`` says whether every FAIL_TO_PASS test passed and
every PASS_TO_PASS test still did. A test the run did not report (deleted, renamed,
never collected) has not passed.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

log = logging.getLogger(__name__)

_BOOT = "from experiments.swe.pytest_server import main; main()"
_MODULE = "agl_pytest_server.py"  # the copy's name: nothing a project would call a module
_BOOT_COPY = "from agl_pytest_server import main; main()"
# Past the run's own timeout, how long the server may take to answer before it is killed.
ANSWER_GRACE_S = 30.0


@dataclass(frozen=True)
class SuiteRun:
    """One run's outcomes (node id to passed, failed, error or skipped)."""

    outcomes: Mapping[str, str]
    messages: Mapping[str, str] = field(default_factory=dict)  # a failure's first line
    timed_out: bool = False
    exit: int | None = None
    seconds: float = 0.0
    output: str = ""

    def passed(self, test: str) -> bool:
        return self.outcomes.get(test) == "passed"


@dataclass(frozen=True)
class Verdict:
    """SWE-smith's grade: resolved when every FAIL_TO_PASS test passes and every
    PASS_TO_PASS test still does."""

    fail_to_pass: tuple[int, int]  # (passed, of)
    pass_to_pass: tuple[int, int]
    timed_out: bool
    not_passed: tuple[str, ...] = field(default=())  # the first few, for the event

    @property
    def resolved(self) -> bool:
        f, fn = self.fail_to_pass
        p, pn = self.pass_to_pass
        return not self.timed_out and f == fn and p == pn

    def details(self) -> dict[str, Any]:
        return {
            "resolved": self.resolved,
            "fail_to_pass": list(self.fail_to_pass),
            "pass_to_pass": list(self.pass_to_pass),
            "timed_out": self.timed_out,
            "not_passed": list(self.not_passed),
        }


def verdict(run: SuiteRun, fail_to_pass: Sequence[str], pass_to_pass: Sequence[str]) -> Verdict:
    """The grade of ``run`` for a task's two test lists."""
    missed = [t for t in (*fail_to_pass, *pass_to_pass) if not run.passed(t)]
    return Verdict(
        fail_to_pass=(sum(run.passed(t) for t in fail_to_pass), len(fail_to_pass)),
        pass_to_pass=(sum(run.passed(t) for t in pass_to_pass), len(pass_to_pass)),
        timed_out=run.timed_out,
        not_passed=tuple(missed[:10]),
    )


class PytestServer:
    """A warm pytest process; ``run`` is one forked test run in a folder."""

    def __init__(
        self,
        prefix: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        boot_dir: Path | None = None,
    ) -> None:
        """``prefix``: what the server runs under (the sandbox's command); ``boot_dir``: a
        folder to run it from, given a copy of its module alone (the sandbox keeps that
        folder in sight and agl's checkout out of it); None: from agl's checkout."""
        if boot_dir is None:
            root = str(Path(__file__).resolve().parents[2])  # experiments' parent
            boot = f"import sys; sys.path.insert(0, {root!r}); {_BOOT}"
        else:
            shutil.copyfile(Path(__file__).with_name("pytest_server.py"), boot_dir / _MODULE)
            os.chmod(boot_dir / _MODULE, 0o644)
            boot = f"import sys; sys.path.insert(0, {str(boot_dir)!r}); {_BOOT_COPY}"
        # Isolated (-I): neither the folder it starts in (the repository, in the sandbox)
        # nor PYTHON* variables reach its sys.path, so a sitecustomize.py or a pytest.py
        # the agent left there is never imported by the process that reports outcomes.
        self._command = [*prefix, sys.executable, "-I", "-c", boot]
        self._env = dict(env) if env is not None else None
        self._process: subprocess.Popen[str] | None = None
        self._lock = threading.Lock()

    def _start(self) -> subprocess.Popen[str]:
        env = dict(self._env if self._env is not None else {})
        env.setdefault("PATH", "/usr/bin:/bin")
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        # the projects' tests need pytest alone; this machine's plugins cost 5-8x
        env.setdefault("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
        return subprocess.Popen(
            self._command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
            cwd="/",
            start_new_session=True,  # its group is killed as one
        )

    def run(
        self,
        cwd: Path,
        args: Sequence[str],
        pythonpath: Sequence[str] = (),
        timeout: float = 60.0,
    ) -> SuiteRun:
        """pytest with ``args`` in ``cwd`` (``pythonpath`` entries relative to it)."""
        request = {
            "cwd": str(cwd),
            "args": list(args),
            "pythonpath": list(pythonpath),
            "timeout": timeout,
        }
        with self._lock:
            for attempt in range(2):
                if self._process is None or self._process.poll() is not None:
                    self._process = self._start()
                assert self._process.stdin is not None and self._process.stdout is not None
                try:
                    self._process.stdin.write(json.dumps(request) + "\n")
                    self._process.stdin.flush()
                    ready, _, _ = select.select(
                        [self._process.stdout], [], [], timeout + ANSWER_GRACE_S
                    )
                    line = self._process.stdout.readline() if ready else None
                except (BrokenPipeError, OSError, ValueError):
                    line = ""
                if line is None:  # a run that would not end, nor let its server answer
                    self._kill()
                    return SuiteRun(outcomes={}, timed_out=True, output="no answer in time")
                try:
                    answer = json.loads(line) if line else None
                except ValueError:
                    answer = None
                if isinstance(answer, dict):
                    return SuiteRun(
                        outcomes=answer.get("outcomes") or {},
                        messages=answer.get("messages") or {},
                        timed_out=bool(answer.get("timed_out")),
                        exit=answer.get("exit"),
                        seconds=float(answer.get("seconds") or 0.0),
                        output=answer.get("output") or "",
                    )
                log.warning("the pytest server died (attempt %d); starting it again", attempt + 1)
                self.close()
        return SuiteRun(outcomes={}, output="the pytest server died twice on this run")

    def _kill(self) -> None:
        process, self._process = self._process, None
        if process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()

    def close(self) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        if process.stdin:
            process.stdin.close()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        if process.stdout:
            process.stdout.close()

    def __enter__(self) -> PytestServer:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.close()
