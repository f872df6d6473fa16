"""Where a task's repository comes from: a local mirror of the projects and their bug
branches, SWE-smith's mirror repositories made of plain files.

SWE-smith keeps each project as a GitHub mirror (``swesmith/<repo>``) with one branch
per bug, and its image holds the checkout. Here a mirror is a folder, with no git::

    <mirror>/<repo>/base/                 the project as released (its tests included)
    <mirror>/<repo>/branches/<branch>.diff the bug, as a diff against base
    <mirror>/<repo>/project.json           how its tests run, which files are tests

so a checkout is a copy of ``base`` with the diff applied (``patch -p1``): nothing in it
remembers the unbugged code (no history, no bytecode), which is what the agent must not
read. ``branches(root)`` lists what a mirror holds, for the filter that removes tasks
whose branch is missing; the same filter reads a published set's branches from a JSON
file (``{"repo": ["branch", ...]}``, e.g. from ``git ls-remote`` of each mirror).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
from pathlib import Path

from agl.core.user_error import UserError
from experiments.swe.projects import Project

BASE = "base"
BRANCHES = "branches"
DIFF = ".diff"
PROJECT = "project.json"  # how the repository's tests run (experiments.swe.projects)


def repo_folder(root: Path, repo: str) -> Path:
    """A repository's folder in a mirror (``owner/name`` keeps its slash as a folder)."""
    if ".." in Path(repo).parts or Path(repo).is_absolute():
        raise UserError(f"repository {repo!r} is not a plain name")
    return root / repo


def branches(root: Path) -> dict[str, list[str]]:
    """Every repository of the mirror at ``root`` and its branches."""
    found: dict[str, list[str]] = {}
    for base in sorted(root.rglob(BASE)):
        if not base.is_dir() or not (base.parent / BRANCHES).is_dir():
            continue
        repo = base.parent.relative_to(root).as_posix()
        names = sorted(p.name[: -len(DIFF)] for p in (base.parent / BRANCHES).glob("*" + DIFF))
        found[repo] = names
    return found


def branches_from_file(path: Path) -> dict[str, list[str]]:
    """A published set's branches: a JSON object of repository to branch names."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise UserError(f"{path}: not a JSON file of branches ({error})") from None
    if not isinstance(data, dict) or not all(
        isinstance(v, list) and all(isinstance(b, str) for b in v) for v in data.values()
    ):
        raise UserError(f'{path}: expected {{"repo": ["branch", ...]}}')
    return {str(k): list(v) for k, v in data.items()}


def write_project(root: Path, project: Project) -> None:
    """Record how ``project``'s tests run beside its base."""
    path = repo_folder(root, project.repo) / PROJECT
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dataclasses.asdict(project), indent=1) + "\n")


def read_project(root: Path, repo: str) -> Project:
    """How ``repo``'s tests run, as the mirror recorded it."""
    path = repo_folder(root, repo) / PROJECT
    try:
        data = json.loads(path.read_text())
        return Project(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})
    except (OSError, ValueError, TypeError) as error:
        raise UserError(f"{path}: no project description ({error})") from None


def add_branch(root: Path, repo: str, branch: str, diff: str) -> Path:
    """Record ``branch`` (a diff against the repository's base) in the mirror."""
    folder = repo_folder(root, repo) / BRANCHES
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / (branch + DIFF)
    path.write_text(diff)
    return path


def checkout(root: Path, repo: str, branch: str | None, dest: Path) -> None:
    """A working copy of ``repo`` at ``branch`` (None: the base) in ``dest``, which must
    not exist yet."""
    base = repo_folder(root, repo) / BASE
    if not base.is_dir():
        raise UserError(f"the mirror {root} has no repository {repo!r}")
    shutil.copytree(base, dest, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", ".git"))
    if branch is None:
        return
    diff = repo_folder(root, repo) / BRANCHES / (branch + DIFF)
    if not diff.is_file():
        raise UserError(f"{repo!r} has no branch {branch!r}")
    apply_diff(dest, diff.read_text())


def apply_diff(folder: Path, diff: str, reverse: bool = False) -> None:
    """Apply a unified diff (a/ and b/ prefixed) to ``folder``; ``UserError`` if it does
    not apply cleanly."""
    args = ["patch", "-p1", "--batch", "--forward", "--no-backup-if-mismatch", "--quiet"]
    if reverse:
        args.append("--reverse")
    done = subprocess.run(args, cwd=folder, input=diff, text=True, capture_output=True, check=False)
    if done.returncode != 0:
        message = (done.stdout + done.stderr).strip().splitlines()
        raise UserError(f"the diff does not apply in {folder}: {message[-1] if message else ''}")
