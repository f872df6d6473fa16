"""Whether something ``tests/run`` installs is in place already, so that a second run
skips its install. Exit status 0 if it is; 1, with what is missing on stderr, if not.

    python tests/installed.py requirements 'torch==2.13.0' ...  # in this Python
    python tests/installed.py requirements -r FILE             # each line of FILE
    python tests/installed.py agl test,verl,k8s    # agl from this checkout, with extras
    python tests/installed.py npm tests/harnesses  # node_modules at package-lock's versions

Runs under any Python >= 3.11 with pip (a venv's own: OpenHands', vLLM's), standard
library only: ``packaging`` is pip's copy where it is not installed itself.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import sys
import tomllib
from pathlib import Path

try:
    from packaging.markers import default_environment
    from packaging.requirements import Requirement
except ImportError:  # a bare venv: pip vendors it
    from pip._vendor.packaging.markers import default_environment
    from pip._vendor.packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent


def unmet(requirement: str, extra: str = "") -> list[str]:
    """``requirement`` and what its extras add, where not installed at an allowed
    version (one level deep: pip saw to the rest when it installed them)."""
    wanted = Requirement(requirement)
    if wanted.marker and not wanted.marker.evaluate({**default_environment(), "extra": extra}):
        return []
    try:
        version = importlib.metadata.version(wanted.name)
    except importlib.metadata.PackageNotFoundError:
        return [f"{requirement} (not installed)"]
    if not wanted.specifier.contains(version, prereleases=True):
        return [f"{requirement} (found {version})"]
    missing = []
    for name in wanted.extras:
        for dependency in importlib.metadata.requires(wanted.name) or []:
            if "extra" in str(Requirement(dependency).marker or ""):
                missing += unmet(dependency, extra=name)
    return missing


def requirement_lines(path: Path) -> list[str]:
    lines = (line.partition("#")[0].strip() for line in path.read_text().splitlines())
    return [line for line in lines if line]


def agl_unmet(extras: list[str]) -> list[str]:
    """agl importable from this checkout (not another one), and its dependencies."""
    spec = importlib.util.find_spec("agl")
    origin = Path(spec.origin).resolve().parent.parent if spec and spec.origin else None
    missing = [] if origin == ROOT else [f"agl from {ROOT} (found {origin})"]
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = list(project["dependencies"])
    for extra in extras:
        requirements += project["optional-dependencies"][extra]
    for requirement in requirements:
        missing += unmet(requirement)
    # a console script added since the last install comes only with a new install
    installed = {e.name for e in importlib.metadata.entry_points(group="console_scripts")}
    missing += [f"agl's command {n!r}" for n in project.get("scripts", {}) if n not in installed]
    return missing


def npm_unmet(folder: Path) -> list[str]:
    """Each dependency of ``folder/package.json`` at its version in the lock."""
    lock = json.loads((folder / "package-lock.json").read_text())["packages"]
    missing = []
    for name in lock[""]["dependencies"]:
        want = lock[f"node_modules/{name}"]["version"]
        installed = folder / "node_modules" / name / "package.json"
        have = json.loads(installed.read_text())["version"] if installed.is_file() else None
        if have != want:
            missing.append(f"{name}@{want} (found {have})")
    return missing


def main(argv: list[str]) -> int:
    command, *args = argv
    if command == "requirements" and args[:1] == ["-r"]:
        missing = [m for line in requirement_lines(Path(args[1])) for m in unmet(line)]
    elif command == "requirements":
        missing = [m for requirement in args for m in unmet(requirement)]
    elif command == "agl":
        missing = agl_unmet([e for e in args[0].split(",") if e] if args else [])
    elif command == "npm":
        missing = npm_unmet(Path(args[0]))
    else:
        raise SystemExit(f"installed.py: unknown command {command!r}")
    for line in missing:
        print(f"missing: {line}", file=sys.stderr)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
