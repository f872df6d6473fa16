"""The settings of ``LocalExecutor`` (``controller=local``), checked as they are made, with
whether its agents run confined; and the timings its processes are handled with."""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from agl.backends.execution.confine import Confinement, Start, code_paths, confined
from agl.sandbox.launch import unavailable

# The package's name, not this module's: the name its log lines carried before the split.
log = logging.getLogger("agl.backends.execution.local")

KILL_GRACE_S = 2.0  # SIGTERM, then SIGKILL this much later
READY_TIMEOUT_S = 60.0  # a worker's import of the harness
RESTART_BACKOFF_S = (0.5, 30.0)  # first and longest wait between failed worker starts


@dataclass
class LocalExecutorConfig:
    harness: str  # "module:function" | "python:module:function" | "command:..."
    run_dir: Path
    workers: int = 2
    concurrency: int = 64  # attempts per worker (python harness) or processes in total (command)
    extra_pythonpath: list[str] = field(default_factory=list)
    # Agents on a read-only tree in namespaces of their own, as a user who owns nothing,
    # ``run_dir``, ``hide`` and the homes out of sight but for ``keep``
    # (agl/backends/execution/confine.py): True, False, or "auto" (when this machine
    # allows it; else a warning and unconfined).
    confine: bool | str = False
    hide: list[str] = field(default_factory=list)
    keep: list[str] = field(default_factory=list)
    # Names of the trainer's environment variables agents get besides the whitelist.
    pass_env: list[str] = field(default_factory=list)
    # The task's grader (agl/grading/), which posts each attempt's reward from here.
    grader: str | None = None

    def __post_init__(self) -> None:
        if self.confine not in (True, False, "auto"):
            raise ValueError(f"confine must be true, false or auto, not {self.confine!r}")
        if self.grader and not self.harness.startswith("command:"):
            raise ValueError(
                f"a grader needs a command: harness (one process per attempt, each with a "
                f"workspace of its own), not {self.harness!r}"
            )

    @contextlib.contextmanager
    def start(
        self,
        argv: Sequence[str],
        env: Mapping[str, str],
        cwd: Path | None = None,
        writable: Sequence[Path] = (),
        pass_fds: Sequence[int] = (),
    ) -> Iterator[Start]:
        """How to start an agent's process: confined (``writable``: its own folders, in
        the hidden ones) or as it is. The block must outlive the process."""
        if not self.confining:
            yield Start(list(argv), {"env": dict(env), "cwd": cwd, "pass_fds": tuple(pass_fds)})
            return
        confinement = Confinement(
            hidden=(Path(self.run_dir), *map(Path, self.hide)),
            kept=(*code_paths(self.extra_pythonpath), *map(Path, self.keep)),
        )
        with confined(argv, confinement, env, cwd or Path.cwd(), writable, pass_fds) as start:
            yield start

    @property
    def confining(self) -> bool:
        """Whether agents run confined; ValueError if asked for and impossible here."""
        if self.confine is False:
            return False
        reason = unavailable()
        if reason is None:
            return True
        if self.confine is True:
            raise ValueError(f"cannot confine the agents ({reason}); set confine=false")
        _warn_unconfined(reason)
        return False


@functools.cache
def _warn_unconfined(reason: str) -> None:
    log.warning("agents run unconfined: %s (they can read the run's folder)", reason)
