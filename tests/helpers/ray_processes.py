"""The processes a test's Ray started, found by a tag in their environment (they inherit
it), so a leak check sees the test's own and not another Ray on the same machine."""

from __future__ import annotations

import os
import time

import psutil

TAG_VAR = "AGL_RAY_TEST"


def tagged(tag: str) -> list[psutil.Process]:
    """Live processes (not this one) whose environment carries ``AGL_RAY_TEST=tag``."""
    found = []
    for proc in psutil.process_iter():
        try:
            mine = proc.pid != os.getpid() and proc.environ().get(TAG_VAR) == tag
            if mine and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def gone(tag: str, timeout_s: float = 30.0) -> list[psutil.Process]:
    """The tagged processes still alive after ``timeout_s`` (Ray stops asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while (left := tagged(tag)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left
