"""What both kinds of harness do with their child processes: signal and kill a process
group, say why a process ended, and build the environment a child starts from."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal

from agl.backends.execution.local.config import HIDDEN_FROM_AGENTS, KILL_GRACE_S


def signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


async def terminate(process: asyncio.subprocess.Process, grace_s: float = KILL_GRACE_S) -> None:
    """SIGTERM the process group, SIGKILL it after ``grace_s``; returns once reaped."""
    if process.returncode is None:
        signal_group(process.pid, signal.SIGTERM)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(process.wait(), grace_s)
    # The leader may be gone while children it started linger in its group.
    signal_group(process.pid, signal.SIGKILL)
    await process.wait()


def exit_reason(code: int) -> str | None:
    """A process's return code as an Exit error: None for 0."""
    if code == 0:
        return None
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)


def base_env(extra_pythonpath: list[str]) -> dict[str, str]:
    """This process's environment for a child, less the admin token: an agent gets only
    its attempt's key (docs/design.md, "Auth")."""
    env = {k: v for k, v in os.environ.items() if k not in HIDDEN_FROM_AGENTS}
    paths = [*extra_pythonpath, *filter(None, [env.get("PYTHONPATH")])]
    if paths:
        env["PYTHONPATH"] = os.pathsep.join(paths)
    return env
