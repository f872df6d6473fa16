"""Running a task's tests: a warm pytest process (``experiments.swe.pytest_server``) and
the verdict SWE-smith's grading gives from its outcomes.

``PytestServer`` starts the server (in a jail, ``agl.sandbox.jail``, when the tests run
the agent's code), sends it one run at a time and starts it again if it died (a test may
kill its parent); ``verdict`` says whether every FAIL_TO_PASS test passed and every
PASS_TO_PASS test still did. A test the run did not report (deleted, renamed, never
collected) has not passed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from agl.sandbox.jail import SITE, Jail, interpreter
from agl.sandbox.launch import Invocation, popen_kwargs
from agl.sandbox.spec import Bind

log = logging.getLogger(__name__)

_BOOT = "from experiments.swe.pytest_server import main; main()"
# In a jail: the server's module alone, bound under a name no project would give a module.
_JAILED = "/opt/agl/boot/agl_pytest_server.py"
_BOOT_JAILED = (
    f"import sys; sys.path[:0] = [{str(Path(_JAILED).parent)!r}, {SITE!r}]; "
    "from agl_pytest_server import main; main()"
)
# One hash seed for every run: a test parametrized over a set (isodate's) has ids that
# follow the set's order, so the ids a task was made with must be the ids it is graded by.
HASH_SEED = "0"
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

    def __init__(self, jail: Jail | None = None, uid: int | None = None) -> None:
        """``jail``: where the server runs, as ``uid`` (the agent's code is imported in
        it); None: here, unconfined, from agl's checkout (tests of known code only)."""
        if jail is None:
            root = str(Path(__file__).resolve().parents[2])  # experiments' parent
            boot = f"import sys; sys.path.insert(0, {root!r}); {_BOOT}"
            executable = sys.executable
        else:
            server = Bind(str(Path(__file__).with_name("pytest_server.py")), _JAILED)
            env = {**jail.env, "PYTHONHASHSEED": HASH_SEED}
            jail = dataclasses.replace(jail, read_only=(*jail.read_only, server), env=env)
            boot, executable = _BOOT_JAILED, str(interpreter())
        # -s -P: neither the folder it starts in (the repository) nor a user's site folder
        # reaches its sys.path, so a sitecustomize.py or a pytest.py the agent left there
        # is never imported by the process that reports outcomes. Not -I, which would
        # ignore PYTHONHASHSEED: its environment is ours alone anyway.
        self._command = [executable, "-s", "-P", "-c", boot]
        self._jail = jail
        self._uid = uid
        self._process: subprocess.Popen[str] | None = None
        self._call: Invocation | None = None
        self._lock = threading.Lock()

    def _start(self) -> subprocess.Popen[str]:
        streams: dict[str, Any] = {
            "stdin": subprocess.PIPE,
            "stdout": subprocess.PIPE,
            "stderr": subprocess.DEVNULL,
            "text": True,
        }
        if self._jail is None:
            env = {
                "PATH": "/usr/bin:/bin",
                "PYTHONDONTWRITEBYTECODE": "1",
                "PYTHONHASHSEED": HASH_SEED,
                # the projects' tests need pytest alone; this machine's plugins cost 5-8x
                "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
            }
            # its group is killed as one
            return subprocess.Popen(
                self._command, env=env, cwd="/", start_new_session=True, **streams
            )
        self._call = Invocation(self._jail.spec(self._command, self._uid))
        process = subprocess.Popen(self._call.argv, **streams, **popen_kwargs(self._call))
        self._call.started()
        return process

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
        self._forget_call()

    def _forget_call(self) -> None:
        call, self._call = self._call, None
        if call is not None:
            call.close()

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
        self._forget_call()

    def __enter__(self) -> PytestServer:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.close()
