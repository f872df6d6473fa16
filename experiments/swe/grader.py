"""The coding task's reward: the task's tests on the agent's change, as SWE-smith grades.

The grader (``conf/task/swe.yaml``'s ``grader``) runs on the controller's side after the
harness exited, so nothing the model's commands reached can post a reward. It does not
run the tests in what the agent left: a fresh checkout of the task's branch, the
grader's own, gets the agent's version of each of the project's *source* files
(``project.json``'s ``sources``) and nothing else. Each is read from the agent's
checkout one path part at a time, without following a link at any of them: a folder
replaced by a link (to the mirror's clean copy, say) is not read through. Edited or
deleted tests, a ``conftest.py`` or ``pytest.ini`` of the agent's, a module shadowing the
standard library, bytecode, links: none of it is carried over (the ``ignored`` list of
the ``grade`` event names what was left behind). Then:

- a source file the agent deleted, replaced by a link (or a folder on its way by one),
  or linked elsewhere gives 0 (the tests would import another copy of the module);
- a change whose added lines name the test runner or the process (``_pytest``,
  ``sys.modules``, ``os._exit``, ``/proc``, ...) gives 0;
- else the grader plants its own tests (``experiments.swe.canaries``: a copy of each
  FAIL_TO_PASS test and one that must fail) and runs FAIL_TO_PASS and PASS_TO_PASS with
  them in the coding task's jail, read-only, as a uid of its own, through a copy of the
  warm pytest that imports pytest and nothing of agl's; outcomes that contradict the
  planted tests were forged by the code under test: 0, and the event says so;
- the reward is 1 when every FAIL_TO_PASS test passes and every PASS_TO_PASS test still
  does, else 0; the ``grade`` event records the breakdown and the change as a diff.
"""

from __future__ import annotations

import asyncio
import difflib
import os
import re
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agl.grading import Grade, GradeRequest
from agl.sandbox.uids import lease
from experiments.swe import mirror
from experiments.swe.canaries import plant
from experiments.swe.harness import REPO, hidden_from_agents, mirror_root
from experiments.swe.instances import Instance
from experiments.swe.projects import Project
from experiments.swe.sandbox import check_available, check_project, tool_jail
from experiments.swe.testrun import PytestServer, verdict

DIFF_CHARS = 20_000
MAX_SOURCE_BYTES = 2_000_000  # a source file larger than this is not a fix
IGNORED_SHOWN = 50
# What a fix of a project's function has no business touching: the test runner, the
# interpreter's module table, its exit, other processes, its frames and builtins.
REACHES_INTO_THE_RUNNER = re.compile(
    r"_pytest|\bpytest\b|sys\.modules|\bos\._exit\b|/proc\b|\bos\.write\b|\bgc\.|"
    r"_getframe|settrace|setprofile|__builtins__|\bbuiltins\b|\bimportlib\b|\bctypes\b"
)


@dataclass(frozen=True)
class Change:
    """What of the agent's checkout the grade carries over."""

    changed: tuple[str, ...]  # source files the agent changed
    missing: tuple[str, ...]  # source files it deleted or replaced by a link
    ignored: tuple[str, ...]  # everything else it changed or added: left behind
    diff: str  # the changed sources, against the branch


def _files(root: Path) -> list[str]:
    """Files and links under ``root`` (links not followed; no .git, no bytecode)."""
    found = []
    for folder, dirs, files in os.walk(root, followlinks=False):
        here = Path(folder)
        dirs[:] = [d for d in dirs if d not in (".git", "__pycache__")]
        for name in files + [d for d in dirs if (here / d).is_symlink()]:
            found.append((here / name).relative_to(root).as_posix())
    return sorted(found)


def read_inside(root: Path, name: str) -> bytes | None:
    """The bytes of the plain file ``name`` under ``root``, each part of the path opened
    without following a link; None when a part is a link (or missing), or the file is
    not a plain file of its own (a device, a pipe, a hard link to another file) or is
    larger than a source file may be."""
    flags = os.O_NOFOLLOW | os.O_CLOEXEC
    *folders, last = Path(name).parts
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | flags)
    except OSError:
        return None
    try:
        for part in folders:
            inner = os.open(part, os.O_RDONLY | os.O_DIRECTORY | flags, dir_fd=fd)
            os.close(fd)
            fd = inner
        file = os.open(last, os.O_RDONLY | os.O_NONBLOCK | flags, dir_fd=fd)
    except OSError:
        return None
    finally:
        os.close(fd)
    info = os.fstat(file)
    plain = stat.S_ISREG(info.st_mode) and info.st_nlink == 1
    if not plain or info.st_size > MAX_SOURCE_BYTES:
        os.close(file)
        return None
    with os.fdopen(file, "rb") as f:
        return f.read(MAX_SOURCE_BYTES + 1)


def carry_over(branch: Path, repo: Path, sources: list[str]) -> Change:
    """The agent's sources (from ``repo``) written over ``branch``, a fresh checkout."""
    changed, missing, diff = [], [], []
    for name in sources:
        mine, theirs = read_inside(repo, name), (branch / name).read_bytes()
        if mine is None:
            missing.append(name)
        elif mine != theirs:
            (branch / name).write_bytes(mine)
            changed.append(name)
            diff += difflib.unified_diff(
                theirs.decode("utf-8", "replace").splitlines(keepends=True),
                mine.decode("utf-8", "replace").splitlines(keepends=True),
                f"a/{name}",
                f"b/{name}",
            )
    kept = set(sources)
    ignored = [
        name
        for name in _files(repo)
        if name not in kept and read_inside(repo, name) != read_inside(branch, name)
    ]
    return Change(tuple(changed), tuple(missing), tuple(ignored), "".join(diff))


def reaches_into_the_runner(diff: str) -> str | None:
    """What an added line of the change names that a fix has no business touching."""
    added = "\n".join(
        line[1:]
        for line in diff.splitlines()
        if line.startswith("+") and not line.startswith("+++")
    )
    found = REACHES_INTO_THE_RUNNER.search(added)
    return found.group(0) if found else None


def _details(change: Change) -> dict[str, Any]:
    return {
        "changed": list(change.changed),
        "missing": list(change.missing),
        "ignored": list(change.ignored[:IGNORED_SHOWN]),
        "diff": change.diff[:DIFF_CHARS],
    }


def _zero(change: Change, why: str, tests: tuple[int, int]) -> Grade:
    return Grade(
        reward=0.0,
        metrics={"fail_to_pass": 0.0, "pass_to_pass": 0.0, "tests_s": 0.0},
        details={
            "resolved": False,
            "refused": why,
            "fail_to_pass": [0, tests[0]],
            "pass_to_pass": [0, tests[1]],
            **_details(change),
        },
    )


def grading_row(instance: Instance, root: Path) -> dict[str, Any]:
    """What the grader reads of a task, as the trainer would pass it (the mirror ``root``)."""
    return {
        "instance_id": instance.instance_id,
        "repo": instance.repo,
        "FAIL_TO_PASS": list(instance.FAIL_TO_PASS),
        "PASS_TO_PASS": list(instance.PASS_TO_PASS),
        "mirror": str(root),
    }


def grade_checkout(row: dict[str, Any], repo: Path, hidden: list[Path]) -> Grade:
    """The reward of the agent's checkout ``repo`` for the task ``row``."""
    root = mirror_root(row)
    project: Project = mirror.read_project(root, row["repo"])
    base = mirror.repo_folder(root, row["repo"]) / mirror.BASE
    f2p, p2p = list(row["FAIL_TO_PASS"]), list(row["PASS_TO_PASS"])
    tests = (len(f2p), len(p2p))
    check_available()
    check_project(project.modules(base))
    with tempfile.TemporaryDirectory(prefix="agl-swe-grade-") as scratch:
        fresh = Path(scratch) / "repo"
        mirror.checkout(root, row["repo"], row["instance_id"], fresh)
        change = carry_over(fresh, repo, project.source_files(base))
        if change.missing:
            return _zero(change, f"source files missing: {', '.join(change.missing)}", tests)
        if reason := reaches_into_the_runner(change.diff):
            return _zero(change, f"the change reaches into the test runner: {reason!r}", tests)
        canaries = plant(fresh, f2p)
        # The checkout is the grader's and read-only: the tests cannot change what runs.
        jail = tool_jail(
            fresh,
            hidden=(*hidden, *hidden_from_agents(root, repo.parent)),
            env={"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"},
            writable=False,
        )
        arguments = project.pytest_arguments([*f2p, *p2p, *canaries.node_ids])
        timeout = float(row.get("test_timeout_s", 120))
        with lease() as uid, PytestServer(jail, uid) as server:
            run = server.run(fresh, arguments, project.pythonpath, timeout)
    if forged := canaries.forged(run.outcomes):
        return _zero(change, f"the reported test outcomes were forged: {forged}", tests)
    result = verdict(run, f2p, p2p)
    f, fn = result.fail_to_pass
    p, pn = result.pass_to_pass
    return Grade(
        reward=1.0 if result.resolved else 0.0,
        metrics={
            "fail_to_pass": f / fn if fn else 1.0,
            "pass_to_pass": p / pn if pn else 1.0,
            "tests_s": run.seconds,
        },
        details={
            **result.details(),
            **_details(change),
            "output": run.output[-2000:] if not result.resolved else "",
        },
    )


async def grade(request: GradeRequest) -> Grade:
    repo = request.file(REPO)
    if repo.is_symlink() or not repo.is_dir():
        raise ValueError("the attempt left no checkout")
    return await asyncio.to_thread(grade_checkout, dict(request.input), repo, [])
