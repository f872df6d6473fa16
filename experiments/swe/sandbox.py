"""The coding agent's sandbox on this machine: each command in namespaces of its own.

The paper's agents reached the reference code four ways: git history, ``curl``/``wget``
of the upstream repository, ``pip download`` of the release, and a Python ``urllib``
fetch; its safeguards hide ``.git``, disable git and cut the network but for
whitelisted services. Here, where nothing but the registries is reachable anyway, a
command can still find the unbugged code on the disk: this machine's local package
indexes and wheel folders (pip installs from them offline), pip's and agl's caches (the
sdists tasks are made from), the task mirror's base, or an installed copy of the project
in site-packages. ``sandboxed(argv, lockdown)`` runs ``argv``

- in its own **network namespace** (nothing but a loopback that is down: no registry,
  no gateway, no other service), **PID namespace** (``/proc`` lists its own processes)
  and **mount namespace**, in which
- the trainer's home folder is covered but for the interpreter, and every folder of
  ``Lockdown.hidden`` is covered by an empty tmpfs no one may enter
  (the workspace, when inside one, is bound back) and every hidden file by an empty one;
  ``/tmp`` is a fresh one of its own;
- ``git`` is a script that refuses, with a message the trajectory shows;
- as an **unprivileged user** (``nobody``) with every capability dropped and
  ``no_new_privs``, so the mounts cannot be undone; the interpreter and agl's code are
  read-only besides (without root, the command is the user who owns them);
- with a **whitelisted environment** (``env -i``): no attempt key, no proxy address, no
  ``PIP_*`` pointing at an index;
- with its own empty ``/var/tmp``, ``/dev/shm``, ``/run/lock`` and ``/dev/mqueue``: no
  other attempt's leftovers (a concurrent rollout of the same task could leave its fix).

It needs root: without it the command would be the trainer's user, who owns what it must
not change. This module says what to hide (``default_hidden``, ``installed_copies``) and
how to run a command (``sandboxed``); ``experiments.swe.sandbox_entry`` is the
namespace's first process, started isolated (``python -I``) so that nothing in the
workspace is imported while it still holds every privilege.
"""

from __future__ import annotations

import functools
import glob
import json
import os
import site
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from experiments.swe.sandbox_entry import NOBODY

# What a shell needs to work, and nothing that names a key, a proxy or an index.
ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    "TERM": "dumb",
    "PAGER": "cat",
    "MANPAGER": "cat",
    "GIT_PAGER": "cat",
    "PYTHONDONTWRITEBYTECODE": "1",
    "PYTHONUNBUFFERED": "1",
    "PIP_NO_INDEX": "1",
    "PIP_CONFIG_FILE": "/dev/null",
}


@dataclass(frozen=True)
class Lockdown:
    """What one sandbox hides and lets through."""

    workspace: Path  # the command's folder, writable by the sandbox's user
    hidden: tuple[Path, ...] = ()  # folders and files no command may read
    # the trainer's home, hidden whole but for the interpreter (pyenv's lives there) and
    # the ``kept`` folders; None: leave it as it is
    home: Path | None = field(default_factory=Path.home)
    kept: tuple[Path, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)  # added to ENV
    block_git: bool = True
    network: bool = False  # True: the machine's network (a control, never for agents)

    def spec(self) -> str:
        return json.dumps(
            {
                "workspace": str(self.workspace.resolve()),
                # a hidden link is hidden where it points, too
                "hidden": sorted(
                    {str(Path(p).absolute()) for p in self.hidden}
                    | {str(Path(p).resolve()) for p in self.hidden}
                ),
                "home": str(self.home.resolve()) if self.home else None,
                "kept": [str(p.resolve()) for p in (*_python_home(), *self.kept)],
                "env": {
                    **ENV,
                    # the interpreter the tests run with comes first
                    "PATH": f"{Path(sys.executable).parent}:{ENV['PATH']}",
                    "HOME": str(self.workspace.resolve()),
                    **self.env,
                },
                "block_git": self.block_git,
            }
        )


def _python_home() -> list[Path]:
    """Where this interpreter lives: a command must reach it to run the tests."""
    return [Path(sys.prefix).resolve(), Path(sys.base_prefix).resolve()]


_INDEX_KEYS = ("index-url", "extra-index-url", "find-links")


def pip_locations() -> list[Path]:
    """The local indexes, wheel folders and config files pip would read here."""
    found: list[Path] = []
    for name in ("PIP_FIND_LINKS", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_CONFIG_FILE"):
        found += _paths(os.environ.get(name, ""))
    try:
        listed = subprocess.run(
            [sys.executable, "-m", "pip", "config", "list"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        listed = ""
    for line in listed.splitlines():
        key, _, value = line.partition("=")
        if key.rpartition(".")[2] in _INDEX_KEYS:
            found += _paths(value.strip().strip("'\""))
    found += [Path("/etc/pip.conf"), Path("/etc/xdg/pip"), Path.home() / ".config" / "pip"]
    found += [Path.home() / ".pip", Path.home() / ".cache"]
    return found


def _paths(value: str) -> list[Path]:
    out = []
    for part in value.split():
        part = part.removeprefix("file://")
        if part.startswith("/"):
            path = Path(part)
            # an index's simple/ folder: hide the whole index
            out.append(path.parent if path.name == "simple" else path)
    return out


SITE_FOLDERS = (
    "/usr/lib/python3*/dist-packages",
    "/usr/lib/python3*/site-packages",
    "/usr/local/lib/python3*/dist-packages",
    "/usr/local/lib/python3*/site-packages",
)


def installed_copies(modules: Iterable[str]) -> list[Path]:
    """Every installed copy of ``modules`` on this machine (a project the task is made
    from may be installed too, by any interpreter: that copy is the fix): the package
    folder or module file, its bytecode, its dist-info, in every site folder."""
    folders = {Path(p) for p in site.getsitepackages()}
    folders |= {Path(p) for pattern in SITE_FOLDERS for p in glob.glob(pattern)}
    found: set[Path] = set()
    for folder in folders:
        for module in modules:
            for pattern in (
                module,
                f"{module}.py",
                f"{module}.*.so",
                f"{module}-*.dist-info",
                f"{module}-*.egg-info",
                f"__pycache__/{module}.*.pyc",
            ):
                found.update(folder.glob(pattern))
    return sorted(found)


@functools.cache
def default_hidden() -> tuple[Path, ...]:
    """What a command must not read on this machine: pip's indexes, wheels, configs and
    caches, and the home folder's caches and configs (agl's sdists among them)."""
    keep = _python_home()
    hidden = {p for p in pip_locations() if p.exists()}
    # a hidden folder must not cover the interpreter the command runs
    return tuple(sorted(p for p in hidden if not any(k == p or p in k.parents for k in keep)))


class SandboxUnavailable(RuntimeError):
    """This machine cannot run the sandbox (not root, or no namespaces)."""


ROOT = Path(__file__).resolve().parents[2]  # the folder experiments/ and agl/ are in
_ENTRY = (
    "import sys; sys.path.insert(0, {root!r}); "
    "from experiments.swe.sandbox_entry import main; main(sys.argv[1:])"
)


def sandboxed(argv: Sequence[str], lockdown: Lockdown) -> list[str]:
    """``argv`` run in the sandbox ``lockdown`` describes; ``SandboxUnavailable``
    without root."""
    if os.geteuid() != 0:
        raise SandboxUnavailable(
            "the coding task's sandbox needs root (it runs each command as nobody)"
        )
    # A clean environment for the namespace's first process too, and -I: neither the
    # workspace it starts in nor PYTHON* variables reach its sys.path.
    prefix = ["env", "-i", "PATH=/usr/bin:/bin", "unshare", "--mount", "--pid", "--fork"]
    prefix += ["--kill-child", "--mount-proc", "--propagation", "private"]
    if not lockdown.network:
        prefix.append("--net")
    entry = _ENTRY.format(root=str(ROOT))
    return [*prefix, sys.executable, "-I", "-c", entry, lockdown.spec(), "--", *argv]


def prepare_workspace(workspace: Path) -> None:
    """The workspace made the sandbox user's: it may write there, and only there."""
    for folder, dirs, files in os.walk(workspace):
        os.chown(folder, NOBODY, NOBODY)
        for name in dirs + files:
            os.lchown(os.path.join(folder, name), NOBODY, NOBODY)
