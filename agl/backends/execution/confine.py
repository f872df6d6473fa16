"""Agents confined on this machine: the run's files, the trainer's code and the other
processes out of their reach, whatever user the trainer is.

A local agent's harness, and its model's shell tools with it, would otherwise run as the
trainer's OS user (root, on many research machines): a tool could read the gateway's
store and admin token, another process's environment and memory, or write a ``.pth``
file into the trainer's site-packages that the next interpreter start runs with every
privilege. ``confined(...)`` runs an agent's command in a sandbox of the machine's tree
(:mod:`agl.sandbox`, the ``host`` view) in which

- **every mount is read-only**: the interpreter, the venv, agl's code, ``/etc``, ``/usr``,
  ``/proc/sys``; the command writes only its scratch folders (``/tmp``, ``/var/tmp``,
  ``/dev/shm``: a tmpfs of its own, also its ``HOME``) and its attempt's workspace;
- the **run folder**, the ``hide`` folders, the trainer's **home** and ``/home`` are
  covered by a tmpfs no one may enter, but for the paths the agent's code needs (the
  interpreter's prefixes, ``sys.path``, ``extra_pythonpath``, the working folder, agl's
  checkout, the ``keep`` folders), bound back read-only, and its workspace, writable;
- it runs in its own PID, IPC, UTS and mount namespaces (``/proc`` lists its own
  processes: no other process's environment, memory or files), as a **uid of its own**
  when the trainer is root (:mod:`agl.sandbox.uids`: it owns nothing of the trainer's),
  else as the trainer's user in a user namespace, with **every capability dropped** and
  no_new_privs;
- the namespace's first process starts isolated (``python -I -S`` on
  ``agl/sandbox/entry.py``, which imports nothing but the standard library): no
  site-packages file runs while it holds privileges.

The network is the machine's: the agent reaches the gateway on loopback (the inference
servers answer only the gateway's key; a NetworkPolicy is the Kubernetes executor's
answer to egress). The harness inherits its pipes and the descriptors it is given, so
workers, logs and the report-key pipe work unchanged; process-group signals reach it.

Every agent's environment, confined or not, is a whitelist (``agent_env``): the launch's
``AGL_*`` variables, what a shell and an interpreter need, and the ``pass_env`` names a
user adds; never the trainer's keys, tokens or settings.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import agl
from agl.sandbox.launch import Invocation, invocation, popen_kwargs
from agl.sandbox.spec import Spec
from agl.sandbox.uids import give, lease

# What a shell and an interpreter need from the trainer's environment, and nothing that
# names a key, a token, a cloud account or a tracker.
PASSED_ENV = frozenset(
    {
        "PATH",
        "LANG",
        "LANGUAGE",
        "TERM",
        "TZ",
        "PYTHONPATH",
        "PYTHONUNBUFFERED",
        "PYTHONIOENCODING",
        "PYTHONDONTWRITEBYTECODE",
        "VIRTUAL_ENV",
        "SSL_CERT_FILE",
        "SSL_CERT_DIR",
        "REQUESTS_CA_BUNDLE",
        "NO_PROXY",
        "no_proxy",
    }
)
PASSED_PREFIXES = ("LC_",)
SCRATCH_HOME = "/tmp"  # a confined agent's HOME: its own scratch tmpfs


def agent_env(
    launch_env: Mapping[str, str],
    extra_pythonpath: Sequence[str] = (),
    pass_env: Iterable[str] = (),
    source: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """An agent's environment: the whitelisted part of ``source`` (the trainer's, by
    default), ``extra_pythonpath`` before its ``PYTHONPATH``, then ``launch_env``."""
    source = os.environ if source is None else source
    passed = PASSED_ENV | set(pass_env)
    env = {k: v for k, v in source.items() if k in passed or k.startswith(PASSED_PREFIXES)}
    paths = [*extra_pythonpath, *filter(None, [env.get("PYTHONPATH")])]
    if paths:
        env["PYTHONPATH"] = os.pathsep.join(paths)
    return {**env, **launch_env}


def homes() -> list[Path]:
    """The users' home folders on this machine: the trainer's, root's, ``/home``."""
    found = {Path.home(), Path("/root"), Path("/home")}
    return sorted(p.resolve() for p in found if p.is_dir())


def code_paths(extra_pythonpath: Sequence[str]) -> list[Path]:
    """What an agent's harness may need to read: the interpreter's prefixes, the module
    search path, agl's own checkout or install, and the working folder."""
    found = [Path(sys.prefix), Path(sys.base_prefix), Path(agl.__file__).parents[1]]
    found += [Path(p) for p in (*sys.path, *extra_pythonpath) if p and os.path.isabs(p)]
    found.append(Path.cwd())
    return sorted({p.resolve() for p in found if p.exists()})


@dataclass(frozen=True)
class Confinement:
    """What a confined agent does not see: ``hidden`` besides the homes, ``kept`` in
    sight within them (read-only)."""

    hidden: tuple[Path, ...]
    kept: tuple[Path, ...] = ()
    homes: tuple[Path, ...] = field(default_factory=lambda: tuple(homes()))

    def spec(
        self,
        argv: Sequence[str],
        env: Mapping[str, str],
        cwd: Path,
        writable: Sequence[Path],
        pass_fds: Sequence[int],
        uid: int | None,
    ) -> Spec:
        return Spec(
            view="host",
            argv=tuple(argv),
            cwd=str(cwd),
            env={**env, "HOME": SCRATCH_HOME},
            hidden=tuple(str(p.resolve()) for p in (*self.homes, *self.hidden)),
            kept=tuple(str(p.resolve()) for p in self.kept),
            writable=tuple(str(p.resolve()) for p in writable),
            uid=uid,
            gid=uid,
            pass_fds=tuple(pass_fds),
            network=True,  # the gateway, on loopback
        )


@dataclass
class Start:
    """What to start an agent's process with: its argv and the keyword arguments of
    ``asyncio.create_subprocess_exec`` besides its streams. ``started()`` once it runs."""

    argv: list[str]
    kwargs: dict[str, Any]
    call: Invocation | None = None

    def started(self) -> None:
        if self.call is not None:
            self.call.started()


@contextlib.contextmanager
def confined(
    argv: Sequence[str],
    confinement: Confinement,
    env: Mapping[str, str],
    cwd: Path,
    writable: Sequence[Path] = (),
    pass_fds: Sequence[int] = (),
) -> Iterator[Start]:
    """``argv`` started confined: a uid of its own held (and ``writable`` made its) for
    as long as the block runs, which must outlive the process."""
    with lease() as uid:
        for folder in writable:
            give(folder, uid)
        spec = confinement.spec(argv, env, cwd, writable, pass_fds, uid)
        with invocation(spec) as call:
            yield Start(call.argv, popen_kwargs(call), call)
