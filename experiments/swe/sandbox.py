"""The coding agent's sandbox: each of its commands, and the grader's test run, in a jail
of its own (:mod:`agl.sandbox.jail`).

The paper's agents reached the reference code four ways: git history, ``curl``/``wget``
of the upstream repository, ``pip download`` of the release, and a Python ``urllib``
fetch; its safeguards hide ``.git``, disable git and cut the network but for whitelisted
services. Here a command runs in a jail that holds the system's programs, a Python with
pytest and what pytest requires and nothing else installed, and the attempt's checkout:

- no network at all (no registry, no gateway, no other service);
- no other copy of the project: no home folder (pip's and agl's caches, the sdists the
  tasks are made from), no package index or wheel folder, no site-packages of any
  interpreter (the task's release may be installed in one), no mirror, no run folder,
  no checkout of agl's. Where a copy usually lies (``known_copies``: pip's indexes,
  wheel folders and caches, the home's caches) and the pipeline's folder, the run's and
  agl's checkout are sealed where they would be, so a command reaching for them is
  refused, and the audit sees it;
- ``git`` prints that it is refused; ``.git`` in the checkout is sealed;
- run as a uid of its own, with no capability, with a whitelisted environment (no key,
  no proxy address), under limits on processes, memory and files; its output is capped.

A project whose modules the test runner itself imports (pytest, pluggy, packaging, ...)
cannot be a task: the jail would hold its clean release (``check_project``).
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

from agl.sandbox.jail import Jail, site_modules
from agl.sandbox.launch import unavailable
from agl.sandbox.spec import Limits

GIT_REFUSED = "git is disabled in this environment: work from the files as they are"
GIT_PROGRAMS = (Path("/usr/lib/git-core"), Path("/usr/libexec/git-core"))
TEST_RUNNER = ("pytest",)  # the distributions a jail's Python holds
OUTPUT_LIMIT = 1 << 20  # bytes of a command's output its caller reads
ROOT = Path(__file__).resolve().parents[2]  # agl's checkout: experiments/ and agl/ are in it
LIMITS = Limits(processes=256, memory_mib=2048, disk_mib=512, file_mib=128)


class SandboxUnavailable(RuntimeError):
    """This machine cannot run the sandbox (no namespaces), or not for this project."""


def check_available() -> None:
    if (reason := unavailable()) is not None:
        raise SandboxUnavailable(f"the coding task's sandbox cannot be made here: {reason}")


def check_project(modules: Iterable[str]) -> None:
    """SandboxUnavailable when the test runner needs one of the project's own modules."""
    shared = sorted(set(modules) & site_modules(TEST_RUNNER))
    if shared:
        raise SandboxUnavailable(
            f"the project's {', '.join(shared)} is what the test runner imports itself: "
            "its clean release would be in the sandbox"
        )


_INDEX_KEYS = ("index-url", "extra-index-url", "find-links")


@functools.cache
def known_copies() -> tuple[Path, ...]:
    """Where a clean release of a project usually lies on a machine: the local indexes,
    wheel folders and configuration pip would read, and the home's caches."""
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
    home = Path.home()
    found += [home / ".cache", home / ".pip", home / ".config" / "pip"]
    return tuple(sorted({p for p in found if p.exists()}))


def _paths(value: str) -> list[Path]:
    out = []
    for part in value.split():
        part = part.removeprefix("file://")
        if part.startswith("/"):
            path = Path(part)
            out.append(path.parent if path.name == "simple" else path)  # the whole index
    return out


def tool_jail(
    workspace: Path,
    hidden: Iterable[Path] = (),
    env: Mapping[str, str] | None = None,
    writable: bool = True,
    block_git: bool = True,
) -> Jail:
    """The jail a command of the agent's (or the tests, ``writable=False``) runs in."""
    sealed = [*known_copies(), *hidden]
    if block_git:
        sealed += [*(p for p in GIT_PROGRAMS if p.is_dir()), workspace / ".git"]
    return Jail(
        workspace=workspace,
        writable=writable,
        python=TEST_RUNNER,
        hidden=tuple(sealed),
        refuse={"git": GIT_REFUSED} if block_git else {},
        env=dict(env or {}),
        limits=LIMITS,
    )
