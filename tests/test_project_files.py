"""The files a project people adopt has, kept true to what the project does."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def test_the_license_file_is_the_one_the_package_declares() -> None:
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["license"]
    assert declared == {"text": "MIT"}
    assert (ROOT / "LICENSE").read_text().startswith("MIT License\n")


def test_ci_runs_every_pre_commit_hook_as_the_hook_runs_it() -> None:
    config = yaml.safe_load((ROOT / ".pre-commit-config.yaml").read_text())
    hooks = [hook for repo in config["repos"] for hook in repo["hooks"]]
    assert {h["id"] for h in hooks} == {"ruff", "ruff-format", "mypy"}
    ci = (ROOT / "tests" / "run").read_text()
    for hook in hooks:
        # the same command on the whole checkout, not on the files a commit touches
        assert hook["pass_filenames"] is False, hook["id"]
        assert re.search(rf"^{re.escape(hook['entry'])}(\s|$)", ci, re.M), hook["entry"]
