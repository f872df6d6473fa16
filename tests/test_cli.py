"""The ``agl`` command (``agl/cli.py``), as installed: each subcommand is its module's
``python -m`` form, its help and its errors included."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from agl.cli import COMMANDS

# pip puts a console script beside the interpreter it installs into
AGL = Path(sys.executable).with_name("agl")


def agl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(AGL), *args], capture_output=True, text=True, timeout=120)


def test_the_install_gives_the_agl_command() -> None:
    assert AGL.exists(), f"no {AGL}: install agl (pip install -e .) to get its console script"
    scripts = importlib.metadata.entry_points(group="console_scripts")
    assert [e.value for e in scripts if e.name == "agl"] == ["agl.cli:main"]


def test_help_lists_every_command_and_version_says_the_installed_one() -> None:
    done = agl("--help")
    assert done.returncode == 0 and not done.stderr
    for name in COMMANDS:
        assert f"\n  {name} " in done.stdout
    assert agl().stdout == done.stdout  # no command: the same help
    version = agl("--version")
    assert version.returncode == 0
    assert version.stdout == f"agl {importlib.metadata.version('agl')}\n"


def test_an_unknown_command_is_one_line_and_status_2() -> None:
    done = agl("trian", "merge=prefix")
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert "unknown command 'trian'" in done.stderr and "train" in done.stderr


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_command_answers_help_as_its_module_does(name: str) -> None:
    module = COMMANDS[name][0]
    assert importlib.util.find_spec(module) is not None
    done = agl(name, "--help")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() and "Traceback" not in done.stderr
    by_module = subprocess.run(
        [sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120
    )
    assert by_module.returncode == 0 and by_module.stdout == done.stdout


def test_train_help_shows_the_config_groups_and_a_bad_choice_is_one_line() -> None:
    done = agl("train", "--help")
    assert "merge: independent, prefix, stitch, tree" in done.stdout
    bad = agl("train", "merge=bogus")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1
    assert bad.stderr.startswith("agl.train: unknown merge 'bogus'")


def test_a_service_command_prints_its_options_with_their_defaults() -> None:
    gateway = agl("gateway", "--help").stdout
    assert "Options (key=value), with their defaults:" in gateway
    assert "  port " in gateway and "8000" in gateway
    bad = agl("controller", "nope=1")
    assert bad.returncode == 2 and bad.stderr.startswith("agl.controller: unknown option 'nope'")
