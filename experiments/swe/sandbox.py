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
  ``PIP_*`` pointing at an index.

Without root the namespaces are entered through a user namespace and the command stays
the (mapped) invoking user. ``default_hidden()`` lists what this machine must hide.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from agl.backends.execution.confine import DROP_PRIVILEGES, cover, hide

NOBODY = 65534
GIT_REFUSED = "git is disabled in this environment: work from the files as they are"
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
                "hidden": [str(Path(p).absolute()) for p in self.hidden],
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


def installed_copies(modules: Iterable[str]) -> list[Path]:
    """The installed files of the distributions that provide ``modules`` (a project the
    task is made from may also be installed here: its site-packages copy is the fix):
    their packages' folders, their modules and bytecode files, their dist-info."""
    found: set[Path] = set()
    providers = metadata.packages_distributions()
    for module in modules:
        for dist in providers.get(module, []):
            try:
                files = metadata.distribution(dist).files or []
            except metadata.PackageNotFoundError:
                continue
            for f in files:
                parts = Path(str(f)).parts
                if not parts or ".." in parts:
                    continue  # scripts in bin/: not the source
                located = Path(str(f.locate()))
                base = located.parents[len(parts) - 1]
                # a package's or dist-info's folder whole; a top-level module file by file
                # (site-packages' shared __pycache__ holds others' bytecode too)
                top = parts[0]
                if len(parts) > 1 and top != "__pycache__":
                    found.add(base / top)
                else:
                    found.add(located)
    return sorted(found)


@functools.cache
def default_hidden() -> tuple[Path, ...]:
    """What a command must not read on this machine: pip's indexes, wheels, configs and
    caches, and the home folder's caches and configs (agl's sdists among them)."""
    keep = _python_home()
    hidden = {p for p in pip_locations() if p.exists()}
    # a hidden folder must not cover the interpreter the command runs
    return tuple(sorted(p for p in hidden if not any(k == p or p in k.parents for k in keep)))


def sandboxed(argv: Sequence[str], lockdown: Lockdown) -> list[str]:
    """``argv`` run in the sandbox ``lockdown`` describes."""
    # The sandbox's first process gets a clean environment too: a command could read
    # its /proc/1/environ where it runs as the same user (without root).
    root = Path(__file__).resolve().parents[2]
    prefix = ["env", "-i", "PATH=/usr/bin:/bin", f"PYTHONPATH={root}", "unshare"]
    if os.geteuid() != 0:
        prefix += ["--user", "--map-root-user"]
    prefix += ["--mount", "--pid", "--fork", "--kill-child", "--mount-proc"]
    prefix += ["--propagation", "private"]
    if not lockdown.network:
        prefix.append("--net")
    return [*prefix, sys.executable, "-m", __name__, lockdown.spec(), "--", *argv]


def prepare_workspace(workspace: Path) -> None:
    """The workspace made the sandbox user's (when run as root): it may write there, and
    only there."""
    if os.geteuid() != 0:
        return
    for folder, dirs, files in os.walk(workspace):
        os.chown(folder, NOBODY, NOBODY)
        for name in dirs + files:
            os.lchown(os.path.join(folder, name), NOBODY, NOBODY)


def _read_only(path: str) -> None:
    """``path`` (the interpreter, agl's code) read-only in the sandbox: without root the
    command runs as the user who owns a user's venv, and could rewrite the pytest that
    reports its outcomes."""
    subprocess.run(["mount", "--bind", path, path], check=True, stdin=subprocess.DEVNULL)
    subprocess.run(["mount", "-o", "remount,bind,ro", path], check=True, stdin=subprocess.DEVNULL)


def _seal(path: str, is_dir: bool) -> None:
    """An empty folder or file no one may open, where a covered one was."""
    parent = os.path.dirname(path)
    missing = []
    while not os.path.lexists(parent):
        missing.append(parent)
        parent = os.path.dirname(parent)
    for folder in reversed(missing):
        os.mkdir(folder, 0o711)
    if is_dir:
        os.mkdir(path, 0o000)
    else:
        os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o000))


def _cover_file(path: str) -> None:
    subprocess.run(["mount", "--bind", "/dev/null", path], check=True, stdin=subprocess.DEVNULL)


def _private_tmp(kept: Sequence[str]) -> None:
    """A fresh, empty /tmp (others' scratch copies and sockets out of sight); the
    ``kept`` folders inside it (the workspace) are bound back in place."""
    inside = [k for k in kept if os.path.commonpath(["/tmp", k]) == "/tmp" and k != "/tmp"]
    cover("/tmp", inside, 0o1777)


def _block_git() -> None:
    git = shutil.which("git", path=ENV["PATH"])
    if git is None:
        return
    stub_dir = "/dev/shm" if os.path.isdir("/dev/shm") else "/run"
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k,mode=755", "agl-git", stub_dir], check=True
    )
    stub = os.path.join(stub_dir, "git")
    with open(stub, "w") as f:
        f.write(f"#!/bin/sh\necho '{GIT_REFUSED}' >&2\nexit 128\n")
    os.chmod(stub, 0o555)
    subprocess.run(["mount", "--bind", stub, os.path.realpath(git)], check=True)


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 3 or args[1] != "--":
        sys.exit("usage: python -m experiments.swe.sandbox SPEC -- COMMAND ...")
    spec, command = json.loads(args[0]), args[2:]
    workspace = spec["workspace"]
    # what each hidden path was before /tmp and the home were covered: one under them is
    # put back sealed, so that a command reaching for it is refused, not left guessing
    kinds = {p: os.path.isdir(p) and not os.path.islink(p) for p in spec["hidden"]}
    kinds = {p: d for p, d in kinds.items() if d or os.path.isfile(p)}
    try:
        _private_tmp([workspace, *spec["kept"]])
        if spec["home"]:
            hide(spec["home"], [workspace, *spec["kept"]])
        for path in spec["kept"]:  # before the covers: a bind made after would lift them
            _read_only(path)
        for path, is_dir in kinds.items():
            if not os.path.lexists(path):
                _seal(path, is_dir)
            elif is_dir and os.path.isdir(path):
                hide(path, [workspace])
            elif os.path.isfile(path):
                _cover_file(path)
        if spec["block_git"]:
            _block_git()
    except (OSError, subprocess.CalledProcessError) as error:
        sys.exit(f"agl sandbox: cannot set up: {error}")
    env = [f"{k}={v}" for k, v in spec["env"].items()]
    user = []
    if os.geteuid() == 0 and os.stat(workspace).st_uid == NOBODY:
        user = [f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
    os.chdir(workspace)
    done = subprocess.run(["setpriv", *user, *DROP_PRIVILEGES, "--", "env", "-i", *env, *command])
    sys.exit(128 - done.returncode if done.returncode < 0 else done.returncode)


if __name__ == "__main__":
    main()
