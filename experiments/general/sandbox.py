"""An attempt's sandbox: a workspace with the task's files and a shell, in a jail of its
own (:mod:`agl.sandbox.jail`), as LLM-in-Sandbox gives its agent a computer.

The jail holds the system's programs, a Python with its standard library alone, and the
workspace: no network, no home folder, no package index or cache, no run folder (W&B's
tables and the checkpoints, wherever they lie), no other attempt's workspace, no
installed package (the tables' own data among them). It runs as a uid the sandbox holds
(no capability, a whitelisted environment: no attempt key, no proxy address) under
limits on processes, memory and files; reaching one ends the sandbox and says which
(``SandboxError``). It is made once per attempt rather than once per command: a command
server (``shell_server.py``) starts in it and runs each of the agent's commands and file
operations, so a command costs a ``bash`` and not a namespace (RL on CPU runs thousands
of attempts).

The workspace (``<root>/<name>``, removed when the sandbox closes):

- ``input/``: the task's files, read-only (hard links to files of root's, mode 0444: the
  agent may read them, not change them for another attempt);
- ``output/``: where the agent leaves its work (``output/answer.txt``).

The sandbox dies with the process that opened it (``die_with_parent``: also on
``kill -9`` of the trainer, whose workers die with it) and everything in it with the
namespace's first process.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agl.sandbox.jail import Jail, interpreter
from agl.sandbox.launch import Invocation, popen_kwargs, unavailable
from agl.sandbox.spec import Limits
from agl.sandbox.uids import lease
from experiments.swe.sandbox import SandboxUnavailable

SERVER = Path(__file__).with_name("shell_server.py")
INPUT, OUTPUT = "input", "output"
OUTPUT_LIMIT = 1 << 16  # bytes of a command's output the server keeps
READ_LIMIT = 1 << 16
LIMITS = Limits(processes=128, memory_mib=1024, disk_mib=256, file_mib=64)


_CAP_SYS_ADMIN = 21


def can_make_namespaces() -> bool:
    """Whether this process holds CAP_SYS_ADMIN (root in a confined worker does not)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> _CAP_SYS_ADMIN & 1)
    except OSError:
        pass
    return False


class SandboxError(RuntimeError):
    """The sandbox failed (not the agent's command): it could not start, or it died."""


@dataclass(frozen=True)
class CommandResult:
    exit: int
    output: str
    truncated: bool
    timed_out: bool


def make_workspace(root: Path, name: str, files: Mapping[str, Path | str]) -> Path:
    """``root/name`` with ``input/`` and an empty ``output/``. ``files``: a name in
    ``input/`` -> a file of root's (the tables' read-only copies), linked, or a text,
    written; root's and read-only (``Sandbox.open`` gives the rest to its user)."""
    workspace = root / name
    workspace.mkdir(parents=True)
    (workspace / INPUT).mkdir()
    (workspace / OUTPUT).mkdir()
    for target, source in files.items():
        if Path(target).name != target:
            raise ValueError(f"an input file's name, not a path: {target!r}")
        if isinstance(source, Path):
            os.link(source, workspace / INPUT / target)
        else:
            (workspace / INPUT / target).write_text(source, encoding="utf-8")
            os.chmod(workspace / INPUT / target, 0o444)
    return workspace


class Sandbox:
    """One attempt's sandbox; ``async with Sandbox.open(...)``, then ``run``, ``read``,
    ``write``. Requests go one at a time."""

    def __init__(
        self,
        workspace: Path,
        process: asyncio.subprocess.Process,
        call: Invocation,
        held: contextlib.ExitStack,
    ) -> None:
        self.workspace = workspace
        self._process = process
        self._call = call
        self._held = held  # the uid it runs as
        self._lock = asyncio.Lock()

    @classmethod
    async def open(cls, workspace: Path, hidden: tuple[Path, ...] = ()) -> Sandbox:
        if os.geteuid() == 0 and not can_make_namespaces():
            raise SandboxUnavailable(
                "the sandbox needs root with CAP_SYS_ADMIN, which a confined harness has "
                "not: run the harness unconfined (controller=general, as conf/general.yaml "
                "does; each attempt's commands are confined in its sandbox)"
            )
        if (reason := unavailable()) is not None:
            raise SandboxUnavailable(f"the sandbox cannot be made here: {reason}")
        jail = Jail(workspace=workspace, python=(), hidden=hidden, limits=LIMITS)
        held = contextlib.ExitStack()
        uid = held.enter_context(lease())
        if uid is not None:  # its folders; the task's files in input/ stay root's
            for folder in (workspace, workspace / OUTPUT):
                os.chown(folder, uid, uid)
        call = Invocation(jail.spec([str(interpreter()), "-I", "-c", SERVER.read_text()], uid))
        try:
            process = await asyncio.create_subprocess_exec(
                *call.argv,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                limit=4 * OUTPUT_LIMIT,
                **popen_kwargs(call),
            )
        except BaseException:
            call.close()
            held.close()
            raise
        call.started()
        return cls(workspace, process, call, held)

    async def __aenter__(self) -> Sandbox:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    async def _ask(self, request: dict[str, Any]) -> dict[str, Any]:
        stdin, stdout = self._process.stdin, self._process.stdout
        assert stdin is not None and stdout is not None
        async with self._lock:
            try:
                stdin.write((json.dumps(request) + "\n").encode())
                await stdin.drain()
                line = await stdout.readline()
            except (ConnectionError, ValueError) as error:
                raise SandboxError(f"the sandbox's server failed: {error}") from None
        if not line:
            raise SandboxError(f"the sandbox died: {await self._why()}")
        try:
            reply = json.loads(line)
        except ValueError:
            reply = None
        if not isinstance(reply, dict):
            raise SandboxError(f"the sandbox's server answered {line[:200]!r}")
        return reply

    async def _why(self) -> str:
        """Why the server is gone: a limit the sandbox reached, or what it printed."""
        assert self._process.stderr is not None
        try:
            text = await asyncio.wait_for(self._process.stderr.read(4096), 5)
            await asyncio.wait_for(self._process.wait(), 5)
        except TimeoutError:
            text = b""
        said = self._call.status().message
        printed = text.decode("utf-8", "replace").strip()
        return said or printed or f"exit {self._process.returncode}"

    async def run(self, command: str, timeout: float) -> CommandResult:
        reply = await self._ask(
            {"op": "run", "command": command, "timeout": timeout, "limit": OUTPUT_LIMIT}
        )
        if "error" in reply:
            return CommandResult(126, str(reply["error"]), False, False)
        try:
            return CommandResult(
                int(reply["exit"]),
                str(reply["output"]),
                bool(reply["truncated"]),
                bool(reply["timed_out"]),
            )
        except (KeyError, TypeError, ValueError):
            raise SandboxError(f"the sandbox's server answered {reply!r:.200}") from None

    async def read(self, path: str, limit: int = READ_LIMIT) -> str:
        """A file's text as the agent sees it (a link is not followed); ``OSError``."""
        reply = await self._ask({"op": "read", "path": path, "limit": limit})
        if "error" in reply:
            raise OSError(reply["error"])
        if "text" not in reply:
            raise SandboxError(f"the sandbox's server answered {reply!r:.200}")
        return str(reply["text"])

    async def write(self, path: str, text: str) -> None:
        reply = await self._ask({"op": "write", "path": path, "text": text})
        if "error" in reply:
            raise OSError(reply["error"])

    async def close(self) -> None:
        """Stop the server (everything in the namespace dies with it) and remove the
        workspace."""
        if self._process.returncode is None:
            self._process.kill()
        await self._process.wait()
        self._call.close()
        self._held.close()
        shutil.rmtree(self.workspace, ignore_errors=True)
