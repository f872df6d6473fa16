"""The coding task's reward: the task's tests on what the agent left, as SWE-smith grades.

The grader (``conf/task/swe.yaml``'s ``grader``) runs on the controller's side after the
harness exited, so nothing the model's commands reached can post a reward. On the
attempt's checkout (``<workspace>/repo``) it

1. puts every test file back as the mirror's base has it, and removes the test files the
   agent added (a ``conftest.py`` of its own would decide what passes): an agent that
   edits tests gains nothing;
2. removes all bytecode (a ``.pyc`` beside an edited module could stand in for it);
3. runs FAIL_TO_PASS and PASS_TO_PASS in the sandbox the agent's commands ran in (the
   tests run the agent's code: no network, nothing hidden comes back into sight);
4. rewards 1 when every FAIL_TO_PASS test passes and every PASS_TO_PASS test still does,
   else 0, and records the breakdown (``grade`` event): the counts, the tests that did
   not pass, the files restored, and the agent's change as a diff against the branch.

No git is involved: the change is read from the files.
"""

from __future__ import annotations

import asyncio
import difflib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from agl.grading import Grade, GradeRequest
from experiments.swe import mirror
from experiments.swe.harness import REPO
from experiments.swe.projects import Project
from experiments.swe.sandbox import Lockdown, default_hidden, prepare_workspace, sandboxed
from experiments.swe.testrun import PytestServer, verdict

EXPERIMENTS_ROOT = Path(__file__).resolve().parents[2]
DIFF_CHARS = 20_000


def _walk(root: Path) -> list[str]:
    """Every file and link under ``root`` (links not followed), relative, sorted."""
    found = []
    for folder, dirs, files in os.walk(root, followlinks=False):
        here = Path(folder)
        for name in files + [d for d in dirs if (here / d).is_symlink()]:
            found.append((here / name).relative_to(root).as_posix())
    return sorted(found)


def _clear_way(repo: Path, relative: str) -> Path:
    """``repo/relative`` made writable as a plain file: a link or file where a folder
    should be, or a link or folder where the file goes, is removed first."""
    target = repo
    parts = Path(relative).parts
    for part in parts[:-1]:
        target = target / part
        if target.is_symlink() or (target.exists() and not target.is_dir()):
            target.unlink()
        target.mkdir(exist_ok=True)
    target = target / parts[-1]
    if target.is_symlink() or target.is_file():
        target.unlink()
    elif target.is_dir():
        shutil.rmtree(target)
    return target


def restore_tests(base: Path, repo: Path, project: Project) -> list[str]:
    """The base's test files put back in ``repo``, and test files the base lacks removed;
    what changed, sorted."""
    changed = []
    for relative in _walk(base):
        if not project.is_test_file(relative):
            continue
        source, target = base / relative, repo / relative
        # the file itself, not one reached through a link on the way
        plain = target.is_file() and target.resolve() == repo.resolve() / relative
        same = plain and target.read_bytes() == source.read_bytes()

        if not same:
            shutil.copyfile(source, _clear_way(repo, relative))
            changed.append(relative)
    for relative in _walk(repo):
        if project.is_test_file(relative) and not (base / relative).exists():
            path = repo / relative
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
            changed.append(relative)
    return sorted(set(changed))


def remove_bytecode(repo: Path) -> None:
    for folder, dirs, files in os.walk(repo, followlinks=False):
        for d in list(dirs):
            if d == "__pycache__":
                shutil.rmtree(Path(folder) / d)
                dirs.remove(d)
        for name in files:
            if name.endswith((".pyc", ".pyo")):
                (Path(folder) / name).unlink()


def agent_diff(root: Path, row: dict[str, Any], repo: Path, project: Project) -> str:
    """The agent's change to the non-test files, as a diff against the task's branch."""
    with tempfile.TemporaryDirectory(prefix="agl-swe-branch-") as scratch:
        branch = Path(scratch) / "branch"
        mirror.checkout(root, row["repo"], row["instance_id"], branch)
        names = sorted(set(_walk(branch)) | set(_walk(repo)))
        out: list[str] = []
        for name in names:
            if project.is_test_file(name) or "__pycache__" in name or name.startswith(".git/"):
                continue
            before = _text(branch / name)
            after = _text(repo / name)
            if before != after:
                out += difflib.unified_diff(
                    before.splitlines(keepends=True),
                    after.splitlines(keepends=True),
                    f"a/{name}",
                    f"b/{name}",
                )
    return "".join(out)[:DIFF_CHARS]


def _text(path: Path) -> str:
    if path.is_symlink():
        return f"<a link to {os.readlink(path)}>\n"
    if not path.is_file():
        return ""
    return path.read_bytes().decode("utf-8", "replace")


def grade_checkout(row: dict[str, Any], repo: Path, hidden: list[Path]) -> Grade:
    """The reward of the checkout ``repo`` for the task ``row``."""
    root = Path(row["mirror"])
    project = mirror.read_project(root, row["repo"])
    base = mirror.repo_folder(root, row["repo"]) / mirror.BASE
    restored = restore_tests(base, repo, project)
    remove_bytecode(repo)
    prepare_workspace(repo)
    lockdown = Lockdown(
        workspace=repo,
        hidden=(*default_hidden(), root.resolve(), *hidden),
        env={"PYTHONPATH": str(EXPERIMENTS_ROOT), "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"},
        kept=(EXPERIMENTS_ROOT,),
    )
    tests = [*row["FAIL_TO_PASS"], *row["PASS_TO_PASS"]]
    timeout = float(row.get("test_timeout_s", 120))
    with PytestServer(prefix=sandboxed([], lockdown)) as server:
        run = server.run(repo, project.pytest_arguments(tests), project.pythonpath, timeout)
    result = verdict(run, row["FAIL_TO_PASS"], row["PASS_TO_PASS"])
    f, fn = result.fail_to_pass
    p, pn = result.pass_to_pass
    return Grade(
        reward=1.0 if result.resolved else 0.0,
        metrics={
            "fail_to_pass": f / fn if fn else 1.0,
            "pass_to_pass": p / pn if pn else 1.0,
            "tests_s": run.seconds,
            "tests_restored": float(len(restored)),
        },
        details={
            **result.details(),
            "restored": restored,
            "diff": agent_diff(root, row, repo, project),
            "output": run.output[-2000:] if not result.resolved else "",
        },
    )


async def grade(request: GradeRequest) -> Grade:
    repo = request.file(REPO)
    if repo.is_symlink() or not repo.is_dir():
        raise ValueError("the attempt left no checkout")
    run_dir = request.workspace.resolve().parent.parent
    return await asyncio.to_thread(grade_checkout, dict(request.input), repo, [run_dir])
