"""Child processes in process groups of their own, as the servers and the node's pods run:
spawned so that the kernel kills them with their parent, signalled and reaped as a group
(so that what a process leaves running goes with it, as when a container ends)."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from agl.core.processes import die_with_parent

# Named for the package: the name log lines and tests' log captures know it by.
log = logging.getLogger("agl.testing.k8s")


def spawn(argv: Sequence[str], log_path: Path, **options: Any) -> subprocess.Popen[bytes]:
    """``argv`` in a session of its own (so its whole group can be signalled), output appended
    to ``log_path``, SIGKILLed by the kernel when the thread that spawned it ends (Linux's
    parent-death signal is per thread), also when this process is killed."""
    with open(log_path, "ab") as out:
        return subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_parent(),
            **options,
        )


# The servers must live as long as this process, whichever thread starts or restarts them
# (a test's helper thread, asyncio.to_thread): they are forked from this one thread, which
# lives until the interpreter exits.
_SERVER_SPAWNER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="k8s-server-spawn")


def spawn_server(argv: Sequence[str], log_path: Path) -> subprocess.Popen[bytes]:
    return _SERVER_SPAWNER.submit(spawn, argv, log_path).result()


def _signal_group(process: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):  # the whole group is gone already
        os.killpg(process.pid, sig)


def kill_group(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL the group and reap the leader. Also after the leader exited: what it left
    running in its group goes too, as when a container ends."""
    _signal_group(process, signal.SIGKILL)
    process.wait()


def terminate_group(process: subprocess.Popen[bytes], grace_s: float) -> None:
    """SIGTERM the group, then SIGKILL it after ``grace_s``."""
    if process.poll() is None:
        _signal_group(process, signal.SIGTERM)
        try:
            process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            log.warning("pid %d ignored SIGTERM for %.0f s; killing it", process.pid, grace_s)
    kill_group(process)


def log_tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
