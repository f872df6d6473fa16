"""What both kinds of harness do with their child processes: signal and kill a process
group, and say why a process ended."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal

from agl.backends.execution.local.config import KILL_GRACE_S


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
