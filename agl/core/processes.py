"""Child processes tied to their parent: a ``preexec_fn`` so that nothing a process starts
outlives it, also on ``kill -9`` (Linux: the kernel's parent-death signal), and an end
that waits for a child but not forever. At the bottom of the house: it imports nothing of
agl's, so every room may use it."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1


_PREEXEC: dict[int, Callable[[], None] | None] = {}


def die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` that asks Linux to SIGKILL the child when its parent dies, also by
    ``kill -9`` (``PR_SET_PDEATHSIG``); None elsewhere. libc is loaded here, once per
    process, so the forked child only makes two system calls (no dlopen after fork, which
    is what makes a ``preexec_fn`` unsafe in a parent running threads)."""
    if os.getpid() not in _PREEXEC:
        _PREEXEC[os.getpid()] = _make_preexec()
    return _PREEXEC[os.getpid()]


def _make_preexec() -> Callable[[], None] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return preexec


def end_process(process: subprocess.Popen[bytes] | None) -> None:
    """Terminate ``process`` if it runs, and kill it if it is not gone within 10 s."""
    if process is None or process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=10)
