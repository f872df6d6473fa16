"""The settings of ``LocalExecutor`` (``controller=local``), checked as they are made, with
whether its agents run confined; and the timings its processes are handled with."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from pathlib import Path

from agl.backends.execution.confine import confined, unavailable

# The package's name, not this module's: the name its log lines carried before the split.
log = logging.getLogger("agl.backends.execution.local")

KILL_GRACE_S = 2.0  # SIGTERM, then SIGKILL this much later
READY_TIMEOUT_S = 60.0  # a worker's import of the harness
RESTART_BACKOFF_S = (0.5, 30.0)  # first and longest wait between failed worker starts
HIDDEN_FROM_AGENTS = frozenset({"AGL_ADMIN_TOKEN"})


@dataclass
class LocalExecutorConfig:
    harness: str  # "module:function" | "python:module:function" | "command:..."
    run_dir: Path
    workers: int = 2
    concurrency: int = 64  # attempts per worker (python harness) or processes in total (command)
    extra_pythonpath: list[str] = field(default_factory=list)
    # Agents in their own PID and mount namespaces without capabilities, ``run_dir`` and
    # ``hide`` out of sight (agl/backends/execution/confine.py): True, False, or "auto"
    # (when this machine allows it; else a warning and unconfined).
    confine: bool | str = False
    hide: list[str] = field(default_factory=list)
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

    def wrap(self, argv: list[str], kept: list[Path] | None = None) -> list[str]:
        """``argv`` as the agent's process runs it: confined (``kept``: folders inside the
        hidden ones that stay in sight) or as it is."""
        if not self.confining:
            return argv
        return confined(argv, [Path(self.run_dir), *map(Path, self.hide)], kept or [])

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
