"""The command harness (``command:<shell command>``): one ``/bin/sh`` process per attempt,
its output in ``run_dir/attempts/``; with a grader, each attempt in a workspace of its own
under ``run_dir/workspaces/``, graded here when it ends and removed."""

from __future__ import annotations

import asyncio
import logging
import shutil
import signal
from dataclasses import replace
from pathlib import Path

from agl.agent import (
    ENV_GRADED,
    ENV_REPORT_FD,
    ENV_WORKSPACE,
    WORKSPACES,
    AgentContext,
    report_pipe,
)
from agl.backends.execution.confine import Start, agent_env
from agl.backends.execution.local.config import LocalExecutorConfig
from agl.backends.execution.local.processes import exit_reason, signal_group, terminate
from agl.core.contracts.execution import ORPHANED, Exit, Key, Launch
from agl.core.processes import die_with_parent
from agl.grading import GradeNotPosted, Grader, grade_attempt, load_grader

# The package's name, not this module's: the name its log lines carried before the split.
log = logging.getLogger("agl.backends.execution.local")


class CommandRunner:
    """Up to ``config.concurrency`` attempt processes of ``command`` at once, each in its
    own session (and, with a grader, its own workspace)."""

    def __init__(self, config: LocalExecutorConfig, command: str) -> None:
        self.config = config
        self.command = command
        self.grader: Grader | None = load_grader(config.grader) if config.grader else None
        self.attempt_dir = Path(config.run_dir) / "attempts"
        self.attempt_dir.mkdir(parents=True, exist_ok=True)
        self.workspace_dir = Path(config.run_dir) / WORKSPACES
        self._argv = ["/bin/sh", "-c", command]
        self.exits: list[Exit] = []
        self.running: dict[tuple[str, int], asyncio.Task[None]] = {}
        self.processes: dict[tuple[str, int], asyncio.subprocess.Process] = {}
        self.stopping: set[Key] = set()
        self.closing = False

    @property
    def free_slots(self) -> int:
        return 0 if self.closing else max(0, self.config.concurrency - len(self.running))

    async def launch(self, launch: Launch) -> None:
        key = (launch.rollout_id, launch.attempt)
        if key in self.running or self.closing:
            return
        task = asyncio.create_task(self._run(launch))
        self.running[key] = task

    async def _run(self, launch: Launch) -> None:
        key = (launch.rollout_id, launch.attempt)
        stem = self.attempt_dir / f"{launch.rollout_id}.{launch.attempt}"
        try:
            error = await self._execute(launch, stem)
        except OSError as failure:
            error = f"cannot start the command: {failure}"
        finally:
            self.running.pop(key, None)
            self.processes.pop(key, None)
        if key in self.stopping:
            self.stopping.discard(key)
            error = ORPHANED
        self.exits.append(Exit(*key, error))

    async def _execute(self, launch: Launch, stem: Path) -> str | None:
        if self.grader is None:
            with report_pipe(launch.report_key) as report_fd:
                env = {**launch.env, ENV_REPORT_FD: str(report_fd)}
                with self.config.start(self._argv, self._env(env), pass_fds=(report_fd,)) as start:
                    process = await self._spawn(launch, stem, start)
                    return await self._wait(launch, process)
        workspace = self.workspace_dir / stem.name
        workspace.mkdir(parents=True, exist_ok=True)
        try:
            env = self._env({**launch.env, ENV_WORKSPACE: str(workspace), ENV_GRADED: "1"})
            with self.config.start(self._argv, env, workspace, writable=[workspace]) as start:
                process = await self._spawn(launch, stem, start)
                error = await self._wait(launch, process)
            return error if error is not None else await self._grade(launch, workspace)
        finally:
            await asyncio.to_thread(shutil.rmtree, workspace, True)

    def _env(self, env: dict[str, str]) -> dict[str, str]:
        return agent_env(env, self.config.extra_pythonpath, self.config.pass_env)

    async def _spawn(self, launch: Launch, stem: Path, start: Start) -> asyncio.subprocess.Process:
        with open(f"{stem}.out", "wb") as out, open(f"{stem}.err", "wb") as err:
            process = await asyncio.create_subprocess_exec(
                *start.argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                **{"start_new_session": True, "preexec_fn": die_with_parent(), **start.kwargs},
            )
        start.started()
        self.processes[(launch.rollout_id, launch.attempt)] = process
        return process

    async def _wait(self, launch: Launch, process: asyncio.subprocess.Process) -> str | None:
        try:
            await asyncio.wait_for(process.wait(), launch.timeout_s)
        except TimeoutError:
            await terminate(process)
            return f"timed out after {launch.timeout_s:g} s"
        except asyncio.CancelledError:
            await asyncio.shield(terminate(process))
            raise
        signal_group(process.pid, signal.SIGKILL)  # an attempt's leftovers end with it
        return exit_reason(process.returncode if process.returncode is not None else -1)

    async def _grade(self, launch: Launch, workspace: Path) -> str | None:
        """Run the grader on what the harness left and post its verdict; None when it is
        posted, else the attempt's error. The grader gets the attempt's timeout anew."""
        assert self.grader is not None
        context = replace(AgentContext.from_env(launch.env), report_key=launch.report_key)
        try:
            return await grade_attempt(self.grader, context, workspace, launch.timeout_s)
        except GradeNotPosted as error:  # the gateway refused or is gone: not the agent's doing
            return str(error)

    def take_exits(self) -> list[Exit]:
        exits, self.exits = self.exits, []
        return exits

    def running_keys(self) -> set[Key]:
        return set(self.running)

    async def stop(self, keys: set[Key]) -> None:
        processes = [(k, p) for k, p in self.processes.items() if k in keys]
        self.stopping.update(k for k, _ in processes)
        await asyncio.gather(*(terminate(p) for _, p in processes))

    async def close(self) -> None:
        self.closing = True
        tasks = list(self.running.values())
        groups = [p.pid for p in self.processes.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for pid in groups:  # in case a cancel landed mid-kill
            signal_group(pid, signal.SIGKILL)

    def pids(self) -> list[int]:
        return [p.pid for p in self.processes.values() if p.returncode is None]
