"""Starting a sandboxed command: ``unshare`` makes the namespaces, ``entry.py`` (run
isolated, ``python -I -S``) builds the tree and runs the command (``agl/sandbox/entry.py``).

``invocation(spec)`` gives what to start (an argv and the descriptors to pass) for any
process API (``subprocess``, ``asyncio``), and reads the status line once the process has
ended; ``run(spec, timeout_s)`` starts it, waits, and answers what it printed (at most the
spec's ``output_limit``), its exit code, and whether a timeout or a limit ended it.

The spec travels in a memory file descriptor, the status back on a pipe: neither is on a
command line. Without root the namespaces are made in a user namespace of the trainer's
user (``--user --map-root-user``); the command then runs as that user, without
capabilities, on a read-only tree. The process ``unshare`` starts gets SIGKILL when
``unshare`` dies, and the namespace's every process dies with it.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agl.core.processes import die_with_parent
from agl.sandbox.spec import Spec

ENTRY = Path(__file__).with_name("entry.py")
SETUP_FAILED = 125  # entry.py's exit code when the sandbox could not be built
_PATH = {"PATH": "/usr/bin:/bin:/usr/sbin:/sbin"}  # for unshare and the entry alone


@dataclass(frozen=True)
class Status:
    """How a sandboxed command ended, as its sandbox saw it."""

    exit: int | None  # None: the sandbox said nothing (killed from outside)
    limit: str | None = None  # processes | memory | disk, when a limit ended it
    error: str | None = None  # the sandbox could not be built

    @property
    def message(self) -> str | None:
        """The sandbox's own words on why the command did not finish as it chose."""
        if self.error:
            return self.error
        return f"the sandbox's {self.limit} limit was reached" if self.limit else None


@dataclass(frozen=True)
class Finished:
    """A command run to its end (or its timeout) in a sandbox."""

    exit: int  # 128 + N for a signal N; -1 when it timed out
    output: str  # stdout and stderr together
    timed_out: bool
    status: Status


class Invocation:
    """What to start for one sandboxed command; the status once it has ended."""

    def __init__(self, spec: Spec) -> None:
        # Close-on-exec, as the pipe's ends are: only the child passed them gets them.
        self._spec_fd = os.memfd_create("agl-sandbox-spec")
        os.write(self._spec_fd, spec.dumps())
        os.lseek(self._spec_fd, 0, os.SEEK_SET)
        self._status_r, self._status_w = os.pipe()
        self.pass_fds = (self._spec_fd, self._status_w, *spec.pass_fds)
        self.argv = [
            *_unshare(spec.network),
            sys.executable,
            "-I",
            "-S",
            str(ENTRY),
            str(self._spec_fd),
            str(self._status_w),
        ]

    def started(self) -> None:
        """Call once the process is started: this side's copies of its ends are closed,
        so that the status pipe ends when the sandbox does."""
        for fd in (self._spec_fd, self._status_w):
            if fd >= 0:
                os.close(fd)
        self._spec_fd = self._status_w = -1

    def status(self) -> Status:
        """The sandbox's status line (call after the process has ended)."""
        os.set_blocking(self._status_r, False)
        try:
            data = os.read(self._status_r, 65536)
        except BlockingIOError:
            data = b""
        return parse_status(data)

    def close(self) -> None:
        self.started()
        if self._status_r >= 0:
            os.close(self._status_r)
            self._status_r = -1


def parse_status(data: bytes) -> Status:
    try:
        answer = json.loads(data) if data.strip() else {}
    except ValueError:
        answer = {}
    if not isinstance(answer, dict):
        answer = {}
    code = answer.get("exit")
    return Status(
        exit=code if isinstance(code, int) else None,
        limit=str(answer["limit"]) if answer.get("limit") else None,
        error=str(answer["error"]) if answer.get("error") else None,
    )


def _unshare(network: bool) -> list[str]:
    prefix = ["unshare"]
    if os.geteuid() != 0:
        prefix += ["--user", "--map-root-user"]
    prefix += ["--mount", "--pid", "--ipc", "--uts", "--fork", "--kill-child", "--mount-proc"]
    prefix += ["--propagation", "private"]
    if not network:
        prefix.append("--net")
    return prefix


@contextlib.contextmanager
def invocation(spec: Spec) -> Iterator[Invocation]:
    """The sandboxed command's argv and descriptors; closed when the block ends."""
    prepared = Invocation(spec)
    try:
        yield prepared
    finally:
        prepared.close()


def run(spec: Spec, timeout_s: float, stdin: bytes | None = None) -> Finished:
    """``spec``'s command to its end, or killed with its namespace after ``timeout_s``.
    Its output is read whole: give the spec an ``output_limit`` when the command is not
    trusted to keep it short."""
    with invocation(spec) as call:
        process = subprocess.Popen(
            call.argv,
            stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            **popen_kwargs(call),
        )
        call.started()
        timed_out = False
        try:
            out, _ = process.communicate(stdin, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            out, _ = process.communicate()
        status = call.status()
    code = -1 if timed_out else process.returncode
    return Finished(code, out.decode("utf-8", "replace"), timed_out, status)


@functools.cache
def unavailable() -> str | None:
    """Why sandboxes cannot be made here (a missing tool, namespaces refused), or None.
    Tried once per process, with a real sandboxed ``true`` in the host view."""
    for tool in ("unshare", "setpriv"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (util-linux)"
    probe = Spec(view="host", argv=("true",), cwd="/", env={"PATH": "/usr/bin:/bin"})
    try:
        done = run(probe, timeout_s=60)
    except OSError as error:
        return f"namespaces are not available: {error}"
    if done.exit != 0:
        reason = done.status.error or (done.output.strip().splitlines() or ["?"])[-1]
        return f"namespaces are not available: {reason}"
    return None


def popen_kwargs(call: Invocation) -> dict[str, Any]:
    """What a ``subprocess``/``asyncio`` start of ``call`` needs besides its streams."""
    return {
        "pass_fds": call.pass_fds,
        "env": _PATH,
        "start_new_session": True,
        "preexec_fn": die_with_parent(),
    }
