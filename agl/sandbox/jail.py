"""A jail for an agent's tools: a machine holding the system's programs, a Python with
only the packages asked for, the attempt's workspace, and nothing else.

Where the coding and general agents' shell commands run (and where the coding task's
tests run to grade it). What a jail holds, read-only unless said:

- ``/usr``, ``/etc`` (but pip's configuration) and the ``/bin``-style links: the shell's
  programs and libraries; every Python ``site-packages``/``dist-packages`` folder of the
  machine is sealed, so no installed package is in reach (a task's project may be one);
- the interpreter's own prefix (its standard library; its site-packages sealed) and, at
  ``/opt/agl/site``, the files of the ``python`` distributions asked for and those they
  require (``("pytest",)`` for a coding task), on ``PYTHONPATH``;
- ``read_only``: more of the machine, each at its own path or where named;
- the **workspace**, at its own path, writable (unless ``writable=False``), owned by the
  jail's user; its ``HOME``.

No home folder, ``/opt``, ``/srv``, ``/var``, run folder, mirror, package index, cache
or other checkout exists in it; ``refuse`` programs print why they are refused; there is
no network (unless ``network``); limits bound its processes, memory and files
(:class:`agl.sandbox.spec.Limits`). ``Jail.spec(argv, uid)`` is the spec to run.
"""

from __future__ import annotations

import functools
import glob
import os
import re
import shutil
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

from agl.sandbox.spec import Bind, Limits, Spec

SITE = "/opt/agl/site"  # where a jail's Python finds the distributions it was given
MACHINE = ("/usr", "/etc")
# Within MACHINE and the interpreter's prefix: what pip reads, and every installed package.
SEALED_GLOBS = (
    "/etc/pip.conf",
    "/etc/xdg/pip",
    "/usr/lib/python3*/site-packages",
    "/usr/lib/python3*/dist-packages",
    "/usr/local/lib/python3*/site-packages",
    "/usr/local/lib/python3*/dist-packages",
    "/usr/share/python-wheels",
)
ENV = {
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    "TERM": "dumb",
    "PAGER": "cat",
    "MANPAGER": "cat",
    "GIT_PAGER": "cat",
    "PYTHONDONTWRITEBYTECODE": "1",
    "PYTHONUNBUFFERED": "1",
}


class JailError(RuntimeError):
    """A jail cannot be made as asked (a distribution that is not installed, ...)."""


@dataclass(frozen=True)
class Jail:
    """One jail's contents; see the module's docstring."""

    workspace: Path
    writable: bool = True
    python: tuple[str, ...] | None = ()  # None: no interpreter; (): its standard library
    read_only: tuple[Bind, ...] = ()
    hidden: tuple[Path, ...] = ()
    refuse: Mapping[str, str] = field(default_factory=dict)  # a program's name -> why
    env: Mapping[str, str] = field(default_factory=dict)
    limits: Limits = field(default_factory=Limits)
    scratch_mib: int = 256
    network: bool = False

    def spec(
        self,
        argv: Sequence[str],
        uid: int | None,
        output_limit: int | None = None,
        cwd: Path | None = None,
    ) -> Spec:
        workspace = str(self.workspace.resolve())
        binds = [Bind(p) for p in MACHINE if os.path.isdir(p)]
        path = ["/usr/local/bin", "/usr/bin", "/bin"]
        env = {**ENV, "HOME": workspace}
        if self.python is not None:
            prefix = python_prefix()
            if not prefix.is_relative_to("/usr"):
                binds.append(Bind(str(prefix)))
            path.insert(0, str(interpreter().parent))
            if self.python:
                binds += site_binds(self.python)
                env["PYTHONPATH"] = SITE
        binds += [*self.read_only, Bind(workspace, writable=self.writable)]
        return Spec(
            view="jail",
            argv=tuple(argv),
            cwd=str(cwd.resolve()) if cwd else workspace,
            env={"PATH": ":".join(path), **env, **self.env},
            binds=tuple(binds),
            hidden=(*sealed(), *(str(p) for p in self.hidden)),
            writable=(workspace,) if self.writable else (),
            refuse=_refused(self.refuse, ":".join(path)),
            uid=uid,
            gid=uid,
            limits=self.limits,
            scratch_mib=self.scratch_mib,
            output_limit=output_limit,
            network=self.network,
        )


def python_prefix() -> Path:
    """The base interpreter's prefix (a venv's python runs from its base's)."""
    return Path(sys.base_prefix).resolve()


def interpreter() -> Path:
    """The base interpreter: the jail's ``python`` (its folder comes first on PATH)."""
    for name in (f"python{sys.version_info.major}.{sys.version_info.minor}", "python3"):
        found = python_prefix() / "bin" / name
        if found.is_file():
            return found
    return Path(os.path.realpath(sys.executable))


@functools.cache
def sealed() -> tuple[str, ...]:
    """The machine's package folders and pip's configuration, and those of the base
    interpreter's prefix and of the running one's (a venv's packages are no less in reach)."""
    prefixes = sorted({python_prefix(), Path(sys.prefix).resolve()})
    patterns = (*SEALED_GLOBS, *(f"{prefix}/lib/python3*/site-packages" for prefix in prefixes))
    return tuple(sorted({p for pattern in patterns for p in glob.glob(pattern)}))


def _refused(programs: Mapping[str, str], path: str) -> dict[str, str]:
    found = {}
    for name, message in programs.items():
        where = shutil.which(name, path=path)
        if where is not None:
            found[os.path.realpath(where)] = message
    return found


@functools.cache
def site_binds(names: tuple[str, ...]) -> tuple[Bind, ...]:
    """Each top-level module, package and metadata folder of the distributions ``names``
    and those they require, bound at ``SITE`` (read from their metadata once a process)."""
    binds: dict[str, Bind] = {}
    for dist in distributions(names):
        for top in _tops(dist):
            source = Path(str(dist.locate_file(top))).resolve()
            if source.exists():
                binds.setdefault(top, Bind(str(source), f"{SITE}/{top}"))
    return tuple(binds.values())


def site_modules(names: Iterable[str]) -> set[str]:
    """What ``import`` can name from ``site_binds(names)``."""
    found = set()
    for dist in distributions(names):
        found |= {t.removesuffix(".py") for t in _tops(dist) if not t.endswith(".dist-info")}
    return found


def distributions(names: Iterable[str]) -> list[metadata.Distribution]:
    """The installed distributions ``names`` and every one they require (extras and
    requirements whose markers do not hold here left out); JailError for a missing one."""
    found: dict[str, metadata.Distribution] = {}
    todo = list(names)
    while todo:
        name = _normal(todo.pop())
        if name in found:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            raise JailError(f"{name!r} is not installed: a jail's Python cannot have it") from None
        found[name] = dist
        todo += [r for r in map(_required, dist.requires or ()) if r is not None]
    return list(found.values())


def _required(requirement: str) -> str | None:
    """The name a requirement line needs here, or None (an extra's, or its marker fails)."""
    parsed = Requirement(requirement)
    if parsed.marker is not None and not parsed.marker.evaluate({"extra": ""}):
        return None
    return parsed.name


def _tops(dist: metadata.Distribution) -> set[str]:
    files = dist.files
    if files is None:
        raise JailError(f"{dist.metadata['Name']} lists no files: it cannot be put in a jail")
    tops = set()
    for file in files:
        top = file.parts[0]
        if top in ("..", "__pycache__") or top.endswith(".pth") or top.startswith("__editable"):
            continue
        tops.add(top)
    return tops


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()
