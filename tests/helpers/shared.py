"""What the whole run builds once, whichever of pytest-xdist's workers asks first."""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest


def built_once(factory: pytest.TempPathFactory, name: str, build: Callable[[Path], object]) -> Path:
    """The folder ``build`` writes, built once per run: read it, never change it.

    The first process to ask builds it in the run's shared temporary folder (under xdist
    the parent of every worker's own) while the others wait on a lock. A build that fails
    leaves nothing behind, and the next process to ask tries again.
    """
    own = factory.getbasetemp()
    shared = own.parent if os.environ.get("PYTEST_XDIST_WORKER") else own
    built = shared / "built-once" / name
    built.parent.mkdir(exist_ok=True)
    with open(built.parent / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = built.parent / f"{name}.done"
        if not done.exists():
            shutil.rmtree(built, ignore_errors=True)
            build(built)
            done.touch()
    return built
