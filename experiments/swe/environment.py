"""mini-swe-agent's local environment with each command run in the coding task's jail.

mini-swe-agent picks its environment from its config file (``environment_class``); this
is the class ``experiments/swe/mini.yaml`` names. It keeps ``LocalEnvironment``'s
interface (the result's ``output``, ``returncode`` and ``exception_info``, the timeout,
the submission check) and runs each command in ``experiments.swe.sandbox``'s jail as the
attempt's uid: its own network, PID, IPC and mount namespaces, nothing of the machine but
the system's programs, pytest and the checkout, ``git`` refused, a whitelisted
environment. ``LocalEnvironment`` alone would hand every command the harness's whole
environment (the attempt's key among it), and read a command's whole output into the
harness's memory: here the jail passes on at most ``OUTPUT_LIMIT`` bytes of it. Its
template variables would carry that environment too: here they hold the config and the
machine's name only.

A command that reaches one of the jail's limits (processes, memory, disk) ends the agent's
run (its exit status ``SandboxLimit``; ``python -m experiments.swe.harness`` then exits
with ``LIMIT_EXIT`` and says which limit on stderr).
"""

from __future__ import annotations

import platform
from pathlib import Path
from typing import Any

from minisweagent.environments.local import LocalEnvironment, LocalEnvironmentConfig
from minisweagent.exceptions import InterruptAgentFlow
from pydantic import Field

from agl.sandbox.launch import run
from experiments.swe.sandbox import OUTPUT_LIMIT, tool_jail

SANDBOX_LIMIT = "SandboxLimit"


class SandboxEnvironmentConfig(LocalEnvironmentConfig):
    hidden: list[str] = Field(default_factory=list)  # sealed where they would be (the mirror)
    block_git: bool = True
    uid: int | None = None  # the attempt's (agl.sandbox.uids.lease), None without root


class SandboxEnvironment(LocalEnvironment):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(config_class=SandboxEnvironmentConfig, **kwargs)
        config: SandboxEnvironmentConfig = self.config  # type: ignore[assignment]
        if not config.cwd:
            raise ValueError("the sandbox needs the workspace as environment.cwd")
        self.jail = tool_jail(
            Path(config.cwd), map(Path, config.hidden), config.env, block_git=config.block_git
        )
        self.uid = config.uid

    def execute(self, action: dict, cwd: str = "", *, timeout: int | None = None) -> dict[str, Any]:
        # The workspace is the only folder the jail has: a cwd elsewhere is ignored.
        seconds = timeout or self.config.timeout
        spec = self.jail.spec(["bash", "-c", action.get("command", "")], self.uid, OUTPUT_LIMIT)
        done = run(spec, seconds)
        if done.status.limit or done.status.error:
            message = done.status.message or ""
            raise InterruptAgentFlow(
                {
                    "role": "exit",
                    "content": message,
                    "extra": {"exit_status": SANDBOX_LIMIT, "submission": "", "reason": message},
                }
            )
        output: dict[str, Any] = {"output": done.output, "returncode": done.exit}
        output["exception_info"] = (
            f"An error occurred while executing the command: timed out after {seconds} seconds"
            if done.timed_out
            else ""
        )
        self._check_finished(output)
        return output

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        return {**self.config.model_dump(), **platform.uname()._asdict(), **kwargs}
