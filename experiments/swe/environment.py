"""mini-swe-agent's local environment with each command run in the sandbox.

mini-swe-agent picks its environment from its config file (``environment_class``); this
is the class ``experiments/swe/mini.yaml`` names. It is ``LocalEnvironment`` (the same
process handling, timeout and submission check) with the command wrapped by
``experiments.swe.sandbox``: its own network, PID and mount namespaces, the unbugged
code and the machine's package indexes out of sight, ``git`` refused, run as ``nobody``
with a whitelisted environment. ``LocalEnvironment`` alone would hand every command the
harness's whole environment, the attempt's key among them (``../shared/NOTES.md``), and
its template variables would carry that environment too: here they hold the config and
the machine's name only.
"""

from __future__ import annotations

import platform
import shlex
from pathlib import Path
from typing import Any

from minisweagent.environments.local import LocalEnvironment, LocalEnvironmentConfig
from pydantic import Field

from experiments.swe.sandbox import Lockdown, default_hidden, sandboxed


class SandboxEnvironmentConfig(LocalEnvironmentConfig):
    hidden: list[str] = Field(default_factory=list)  # out of the commands' sight (the mirror)
    block_git: bool = True


class SandboxEnvironment(LocalEnvironment):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(config_class=SandboxEnvironmentConfig, **kwargs)
        config: SandboxEnvironmentConfig = self.config  # type: ignore[assignment]
        if not config.cwd:
            raise ValueError("the sandbox needs the workspace as environment.cwd")
        self.lockdown = Lockdown(
            workspace=Path(config.cwd),
            # a .git left in the checkout holds the unbugged code in its history
            hidden=(*default_hidden(), *map(Path, config.hidden), Path(config.cwd) / ".git"),
            env=config.env,
            block_git=config.block_git,
        )

    def execute(self, action: dict, cwd: str = "", *, timeout: int | None = None) -> dict[str, Any]:
        command = action.get("command", "")
        wrapped = shlex.join(sandboxed(["bash", "-c", command], self.lockdown))
        # the workspace is the only folder the sandbox keeps: a cwd elsewhere is ignored
        return super().execute({**action, "command": wrapped}, self.config.cwd, timeout=timeout)

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        return {**self.config.model_dump(), **platform.uname()._asdict(), **kwargs}
