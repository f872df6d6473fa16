"""``tests/installed.py``, which lets ``tests/run`` skip an install that is in place: it
says yes only to the pinned versions, and names what is missing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.installed import main

PYTEST = f"pytest=={pytest.__version__}"


def test_installed_requirements_pass_and_others_are_named(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["requirements", PYTEST, "pyyaml>=6"]) == 0
    assert main(["requirements", PYTEST, "pytest<1", "no-such-package-agl==1.0"]) == 1
    assert capsys.readouterr().err.splitlines() == [
        f"missing: pytest<1 (found {pytest.__version__})",
        "missing: no-such-package-agl==1.0 (not installed)",
    ]


def test_a_requirement_for_another_platform_or_extra_is_not_needed() -> None:
    assert main(["requirements", "no-such-package-agl; sys_platform == 'nowhere'"]) == 0
    assert main(["requirements", "no-such-package-agl; extra == 'other'"]) == 0


def test_a_requirements_file_is_read_without_its_comments(tmp_path: Path) -> None:
    path = tmp_path / "requirements.txt"
    path.write_text(f"# pinned\n{PYTEST}  # the runner\n\n")
    assert main(["requirements", "-r", str(path)]) == 0
    path.write_text("no-such-package-agl==1.0\n")
    assert main(["requirements", "-r", str(path)]) == 1


def test_node_modules_must_hold_the_locked_versions(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lock = {
        "packages": {
            "": {"dependencies": {"harness": "1.2.3"}},
            "node_modules/harness": {"version": "1.2.3"},
        }
    }
    (tmp_path / "package-lock.json").write_text(json.dumps(lock))
    assert main(["npm", str(tmp_path)]) == 1  # nothing installed yet
    installed = tmp_path / "node_modules" / "harness" / "package.json"
    installed.parent.mkdir(parents=True)
    installed.write_text(json.dumps({"version": "1.2.2"}))
    assert main(["npm", str(tmp_path)]) == 1
    assert capsys.readouterr().err.splitlines()[-1] == "missing: harness@1.2.3 (found 1.2.2)"
    installed.write_text(json.dumps({"version": "1.2.3"}))
    assert main(["npm", str(tmp_path)]) == 0
