"""The sandbox's first process (``experiments.swe.sandbox``): it sets up the namespaces'
mounts as root, then runs the command as ``nobody`` with no capabilities.

Started as ``python -I -c ...`` with its spec and the command on the command line: it
imports only the standard library and agl's confinement helpers, so nothing the command
left in the workspace (a ``json.py``, an ``experiments/`` folder) runs while it still
holds every privilege. The order of the mounts matters:

1. a fresh ``/tmp`` (and ``/var/tmp``, ``/dev/shm``, ``/run/lock``, ``/dev/mqueue``),
   the workspace bound back when it lives there;
2. the trainer's home covered but for the interpreter and the kept folders;
3. the interpreter and kept folders bound read-only (before 4: a bind made after would
   lift the covers inside them);
4. each hidden folder covered by a sealed tmpfs, each hidden file by an empty one; one
   that 1 or 2 already covered is put back sealed, so a command reaching for it is
   refused rather than told it does not exist;
5. ``git`` (and git's own programs) replaced by a refusal.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence

from agl.backends.execution.confine import DROP_PRIVILEGES, cover, hide

NOBODY = 65534
GIT_REFUSED = "git is disabled in this environment: work from the files as they are"
SCRATCH = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock", "/dev/mqueue")
SCRATCH_SIZE = "512m"  # per scratch folder: a command cannot fill the machine's memory
GIT_PROGRAMS = ("/usr/lib/git-core", "/usr/libexec/git-core")


def _run(*args: str) -> None:
    subprocess.run(list(args), check=True, stdin=subprocess.DEVNULL)


def _scratch(kept: Sequence[str]) -> None:
    for folder in SCRATCH:
        if os.path.isdir(folder) and not os.path.islink(folder):
            inside = [k for k in kept if os.path.commonpath([folder, k]) == folder and k != folder]
            cover(folder, inside, 0o1777, size=SCRATCH_SIZE)


def _read_only(path: str) -> None:
    _run("mount", "--bind", path, path)
    _run("mount", "-o", "remount,bind,ro", path)


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


def _block_git(path: str) -> None:
    git = shutil.which("git", path=path)
    # in the namespace's own /dev/shm (or /tmp), in a folder of root's: nobody can change it
    stub_dir = os.path.join("/dev/shm" if os.path.isdir("/dev/shm") else "/tmp", ".agl-git")
    os.mkdir(stub_dir, 0o755)
    stub = os.path.join(stub_dir, "git")
    with open(stub, "w") as f:
        f.write(f"#!/bin/sh\necho '{GIT_REFUSED}' >&2\nexit 128\n")
    os.chmod(stub, 0o555)
    if git is not None:
        _run("mount", "--bind", stub, os.path.realpath(git))
    for programs in GIT_PROGRAMS:  # git-core/git is its own copy of git
        if os.path.isdir(programs):
            hide(programs, [])


def main(argv: Sequence[str]) -> None:
    if len(argv) < 3 or argv[1] != "--":
        sys.exit("usage: experiments.swe.sandbox_entry SPEC -- COMMAND ...")
    spec, command = json.loads(argv[0]), list(argv[2:])
    workspace = spec["workspace"]
    if os.geteuid() != 0 or os.stat(workspace).st_uid != NOBODY:
        sys.exit("agl sandbox: the workspace is not prepared (prepare_workspace: owned by nobody)")
    # what each hidden path was before the scratch folders and the home were covered
    kinds = {p: os.path.isdir(p) and not os.path.islink(p) for p in spec["hidden"]}
    kinds = {p: d for p, d in kinds.items() if d or os.path.isfile(p)}
    try:
        _scratch([workspace, *spec["kept"]])
        if spec["home"]:
            hide(spec["home"], [workspace, *spec["kept"]])
        for path in spec["kept"]:
            _read_only(path)
        for path, is_dir in kinds.items():
            if not os.path.lexists(path):
                _seal(path, is_dir)
            elif is_dir and os.path.isdir(path):
                hide(path, [workspace])
            elif os.path.isfile(path):
                _run("mount", "--bind", "/dev/null", path)
        if spec["block_git"]:
            _block_git(spec["env"]["PATH"])
    except (OSError, subprocess.CalledProcessError) as error:
        sys.exit(f"agl sandbox: cannot set up: {error}")
    env = [f"{k}={v}" for k, v in spec["env"].items()]
    user = [f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
    os.chdir(workspace)
    done = subprocess.run(["setpriv", *user, *DROP_PRIVILEGES, "--", "env", "-i", *env, *command])
    sys.exit(128 - done.returncode if done.returncode < 0 else done.returncode)
