"""The real projects tasks are made from (``conf/swe/projects.yaml``): where their source
distributions come from, how they unpack into a mirror, and how their tests are run.

A project's release is fetched with pip (``pip download --no-binary :all: --no-deps``:
the registry, or this machine's local indexes), kept in a cache, and unpacked without
its packaging metadata; nothing is installed: the tests import the project from its own
folder (``pythonpath``), so a bug written into a file is the code the tests run.
"""

from __future__ import annotations

import fnmatch
import subprocess
import sys
import tarfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from agl.core.repository import CONF
from agl.core.user_error import UserError

PROJECTS = CONF / "swe" / "projects.yaml"


@dataclass(frozen=True)
class Project:
    name: str
    version: str
    sources: tuple[str, ...]  # globs of the modules bugs go into
    tests: tuple[str, ...]  # pytest's arguments: files or folders
    pythonpath: tuple[str, ...]
    test_files: tuple[str, ...]  # globs an agent may not change
    pytest_args: tuple[str, ...]
    # the base is the release less its sources' docstrings (experiments/swe/docstrings.py)
    strip_docstrings: bool = False

    @property
    def repo(self) -> str:
        """The mirror's name for the release, as SWE-smith names its mirrors
        (``<project>.<commit>``; a release here)."""
        return f"{self.name}.{self.version}"

    def is_test_file(self, path: str) -> bool:
        return any(_match(path, pattern) for pattern in self.test_files)

    def source_files(self, root: Path) -> list[str]:
        """The project's modules under ``root`` that bugs may go into, sorted."""
        found = {
            p.relative_to(root).as_posix()
            for pattern in self.sources
            for p in root.glob(pattern)
            if p.is_file() and p.suffix == ".py"
        }
        return sorted(f for f in found if not self.is_test_file(f))

    def modules(self, root: Path) -> list[str]:
        """The top-level modules the project's sources make (what ``import`` names)."""
        found = set()
        for path in self.source_files(root):
            for entry in self.pythonpath:
                prefix = "" if entry in ("", ".") else entry.rstrip("/") + "/"
                if path.startswith(prefix):
                    first = path[len(prefix) :].split("/")[0]
                    found.add(first.removesuffix(".py"))
                    break
        return sorted(found)

    def pytest_arguments(self, tests: Sequence[str] | None = None) -> list[str]:
        """pytest's arguments for ``tests`` (node ids), or for the whole suite."""
        return [*self.pytest_args, *(tests if tests is not None else self.tests)]


def _match(path: str, pattern: str) -> bool:
    # "tests/**" matches everything below tests/; "**/x" also matches x at the top
    if fnmatch.fnmatch(path, pattern):
        return True
    return pattern.startswith("**/") and fnmatch.fnmatch(path, pattern[3:])


def load_projects(path: Path = PROJECTS) -> dict[str, Project]:
    """Every project of the yaml file at ``path``."""
    try:
        data: Mapping[str, Any] = yaml.safe_load(path.read_text())
        common = {
            "test_files": tuple(data["test_files"]),
            "pytest_args": tuple(data.get("pytest_args") or ()),
        }
        return {
            name: Project(
                name=name,
                version=str(spec["version"]),
                sources=tuple(spec["sources"]),
                tests=tuple(spec["tests"]),
                pythonpath=tuple(spec.get("pythonpath") or (".",)),
                strip_docstrings=bool(spec.get("strip_docstrings", False)),
                **common,
            )
            for name, spec in data["projects"].items()
        }
    except (OSError, yaml.YAMLError, KeyError, TypeError, AttributeError) as error:
        raise UserError(f"{path}: not a projects file ({error!r})") from None


def fetch_sdist(project: Project, cache: Path) -> Path:
    """The project's source distribution, downloaded into ``cache`` once."""
    cache.mkdir(parents=True, exist_ok=True)
    prefix = f"{project.name}-{project.version}"
    for found in sorted(cache.glob(prefix + ".tar.gz")):
        return found
    spec = f"{project.name}=={project.version}"
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps"]
    command += ["--no-binary", ":all:", "--dest", str(cache), spec]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    found_all = sorted(cache.glob(prefix + ".tar.gz"))
    if done.returncode != 0 or not found_all:
        last = (done.stderr.strip().splitlines() or ["no source distribution"])[-1]
        raise UserError(f"cannot download {spec}'s source: {last}")
    return found_all[0]


def unpack(sdist: Path, dest: Path) -> None:
    """The sdist's files into ``dest`` (its top folder stripped; no packaging metadata)."""
    with tarfile.open(sdist) as archive:
        members = []
        for member in archive.getmembers():
            parts = Path(member.name).parts
            if len(parts) < 2 or parts[1] == "PKG-INFO" or parts[1].endswith(".egg-info"):
                continue
            member.name = Path(*parts[1:]).as_posix()
            members.append(member)
        dest.mkdir(parents=True, exist_ok=True)
        archive.extractall(dest, members=members, filter="data")
