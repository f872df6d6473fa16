"""experiments/swe's sandbox, warm pytest and grader, each on its own: what a command in
the sandbox can and cannot reach, the forked pytest's outcomes and timeout, and the
grader's restoring of tests and SWE-smith's verdict."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from agl.agent import ENV_API_KEY
from agl.backends.execution.confine import unavailable
from experiments.swe.grader import remove_bytecode, restore_tests
from experiments.swe.projects import load_projects
from experiments.swe.sandbox import (
    GIT_REFUSED,
    NOBODY,
    Lockdown,
    installed_copies,
    prepare_workspace,
    sandboxed,
)
from experiments.swe.testrun import PytestServer, SuiteRun, verdict

needs_namespaces = pytest.mark.skipif(
    unavailable() is not None, reason=f"no namespaces here: {unavailable()}"
)
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="the drop to nobody needs root")

PROJECT = {
    "src/mini/__init__.py": (
        "def add(a, b):\n    return a + b\n\n\ndef spin():\n    while True:\n        pass\n"
    ),
    "tests/test_mini.py": textwrap.dedent(
        """
        import pytest
        from mini import add, spin


        def test_add():
            assert add(1, 2) == 3


        def test_wrong():
            assert add(1, 1) == 3, "one and one"


        @pytest.fixture
        def broken():
            raise RuntimeError("no fixture")


        def test_setup(broken):
            pass


        @pytest.mark.parametrize("x", [1, 2])
        def test_param(x):
            assert x == 1


        def test_spin():
            spin()
        """
    ),
}


def _project(root: Path) -> Path:
    for name, text in PROJECT.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_the_warm_pytest_reports_each_outcome_and_kills_a_loop(tmp_path: Path) -> None:
    repo = _project(tmp_path / "repo")
    with PytestServer() as server:
        run = server.run(repo, ["tests", "--deselect", "tests/test_mini.py::test_spin"], ["src"])
        assert run.outcomes == {
            "tests/test_mini.py::test_add": "passed",
            "tests/test_mini.py::test_wrong": "failed",
            "tests/test_mini.py::test_setup": "error",
            "tests/test_mini.py::test_param[1]": "passed",
            "tests/test_mini.py::test_param[2]": "failed",
        }
        assert "one and one" in run.messages["tests/test_mini.py::test_wrong"]
        assert not run.timed_out and run.exit == 1
        looped = server.run(repo, ["tests/test_mini.py::test_spin"], ["src"], timeout=2)
        assert looped.timed_out and looped.outcomes == {}
        again = server.run(repo, ["tests/test_mini.py::test_add"], ["src"])  # still serving
        assert again.outcomes == {"tests/test_mini.py::test_add": "passed"}
    assert not list(repo.rglob("__pycache__"))  # no bytecode left behind


def test_the_verdict_is_swe_smiths() -> None:
    run = SuiteRun(outcomes={"f1": "passed", "f2": "passed", "p1": "passed", "p2": "failed"})
    assert verdict(run, ["f1", "f2"], ["p1"]).resolved
    broken = verdict(run, ["f1"], ["p1", "p2", "gone"])
    assert not broken.resolved and broken.pass_to_pass == (1, 3)
    assert broken.not_passed == ("p2", "gone")  # a test not reported has not passed
    assert not verdict(SuiteRun(outcomes={"f1": "passed"}, timed_out=True), ["f1"], []).resolved


def test_restoring_tests_undoes_every_way_of_changing_them(tmp_path: Path) -> None:
    project = load_projects()["isodate"]
    base, repo = tmp_path / "base", tmp_path / "repo"
    for root in (base, repo):
        (root / "tests").mkdir(parents=True)
        (root / "tests" / "test_a.py").write_text("def test_a():\n    assert False\n")
        (root / "tests" / "test_b.py").write_text("def test_b():\n    pass\n")
        (root / "pyproject.toml").write_text("[tool.pytest.ini_options]\n")
        (root / "src").mkdir()
        (root / "src" / "code.py").write_text("x = 1\n")
    (repo / "tests" / "test_a.py").write_text("def test_a():\n    pass\n")  # edited
    (repo / "tests" / "test_b.py").unlink()  # deleted
    (repo / "tests" / "conftest.py").write_text("# decides what passes\n")  # added
    (repo / "conftest.py").write_text("# at the top too\n")
    (repo / "pyproject.toml").unlink()
    (repo / "pyproject.toml").symlink_to("/etc/hostname")  # a link where the file was
    (repo / "src" / "code.py").write_text("x = 2\n")  # the agent's fix: kept
    (repo / "src" / "__pycache__").mkdir()
    (repo / "src" / "__pycache__" / "code.cpython-311.pyc").write_bytes(b"stale")
    restored = restore_tests(base, repo, project)
    remove_bytecode(repo)
    assert restored == [
        "conftest.py",
        "pyproject.toml",
        "tests/conftest.py",
        "tests/test_a.py",
        "tests/test_b.py",
    ]
    for name in ("tests/test_a.py", "tests/test_b.py", "pyproject.toml"):
        assert (repo / name).read_bytes() == (base / name).read_bytes()
        assert not (repo / name).is_symlink()
    assert not (repo / "conftest.py").exists() and not (repo / "tests" / "conftest.py").exists()
    assert (repo / "src" / "code.py").read_text() == "x = 2\n"
    assert not (repo / "src" / "__pycache__").exists()
    assert restore_tests(base, repo, project) == []


def test_a_test_folder_replaced_by_a_link_is_put_back(tmp_path: Path) -> None:
    project = load_projects()["xmltodict"]
    base, repo = tmp_path / "base", tmp_path / "repo"
    (base / "tests").mkdir(parents=True)
    (base / "tests" / "test_x.py").write_text("def test_x():\n    assert 0\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "test_x.py").write_text("def test_x():\n    pass\n")
    repo.mkdir()
    (repo / "tests").symlink_to(elsewhere)
    assert restore_tests(base, repo, project) == ["tests/test_x.py"]
    assert (repo / "tests").is_dir() and not (repo / "tests").is_symlink()
    assert (repo / "tests" / "test_x.py").read_text() == "def test_x():\n    assert 0\n"
    assert (elsewhere / "test_x.py").read_text() == "def test_x():\n    pass\n"  # untouched


def _in_sandbox(workspace: Path, command: str, **lockdown: object) -> subprocess.CompletedProcess:
    return subprocess.run(
        sandboxed(["bash", "-c", command], Lockdown(workspace=workspace, **lockdown)),
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, ENV_API_KEY: "sk-attempt-secret"},
    )


@needs_namespaces
@needs_root
def test_a_command_runs_as_nobody_in_its_workspace_with_nothing_else_in_reach(
    tmp_path: Path,
) -> None:
    workspace = tmp_path / "ws"
    workspace.mkdir()
    (workspace / "mine.txt").write_text("mine")
    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / "fix.py").write_text("the fix")
    single = tmp_path / "single.txt"
    single.write_text("also the fix")
    prepare_workspace(workspace)
    assert workspace.stat().st_uid == NOBODY
    done = _in_sandbox(
        workspace,
        "id -u; cat mine.txt; echo; touch new.txt && echo wrote; "
        f"cat {secret}/fix.py || echo sealed; cat {single} || echo covered; "
        "ls /tmp | wc -l; env; git status || true; "
        "python -c \"import urllib.request as u; u.urlopen('http://1.1.1.1', timeout=3)\" "
        "|| echo offline; touch /usr/local/x || echo readonly; "
        f"touch {Path(sys.prefix) / 'tampered'} || echo interpreter-readonly",
        hidden=(secret, single),
    )
    out = done.stdout
    assert out.startswith(f"{NOBODY}\nmine\nwrote\n"), out
    assert "sealed" in out and "covered" in out and "offline" in out and "readonly" in out
    assert "interpreter-readonly" in out and not (Path(sys.prefix) / "tampered").exists()
    assert "the fix" not in out
    assert ENV_API_KEY not in out and "sk-attempt-secret" not in out
    assert GIT_REFUSED in done.stderr
    assert (workspace / "new.txt").exists()  # written through to the real folder


@needs_namespaces
def test_an_installed_copy_of_the_project_is_out_of_sight(tmp_path: Path) -> None:
    copies = installed_copies(["pytest"])  # any installed package stands in for one
    assert any(p.name == "_pytest" for p in copies)
    workspace = tmp_path / "ws"
    workspace.mkdir()
    prepare_workspace(workspace)
    module = next(p for p in copies if p.name == "_pytest") / "main.py"
    done = _in_sandbox(workspace, f"cat {module} | head -1 || echo hidden", hidden=tuple(copies))
    assert "hidden" in done.stdout or "Permission denied" in done.stderr
    assert "import" not in done.stdout


@needs_namespaces
def test_the_tests_run_in_the_sandbox_through_the_warm_pytest(tmp_path: Path) -> None:
    repo = _project(tmp_path / "repo")
    shutil.rmtree(repo / "tests" / "__pycache__", ignore_errors=True)
    prepare_workspace(repo)
    root = Path(__file__).resolve().parents[1]
    lockdown = Lockdown(
        workspace=repo,
        env={"PYTHONPATH": str(root), "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"},
        kept=(root,),
    )
    with PytestServer(prefix=sandboxed([], lockdown)) as server:
        run = server.run(repo, ["tests/test_mini.py::test_add", "-p", "no:cacheprovider"], ["src"])
    assert run.outcomes == {"tests/test_mini.py::test_add": "passed"}


@needs_namespaces
def test_what_the_agent_leaves_in_the_repository_never_runs_in_the_reporting_process(
    tmp_path: Path,
) -> None:
    """A sitecustomize.py or a pytest.py in the repository (the sandbox starts the server
    there) would run before any test and could rewrite every outcome."""
    repo = _project(tmp_path / "repo")
    forced = (
        "import _pytest.reports as r\n"
        "r.TestReport.outcome = property(lambda self: 'passed', lambda self, v: None)\n"
        "open('imported-' + __name__, 'w').close()\n"
    )
    (repo / "sitecustomize.py").write_text(forced)
    (repo / "pytest.py").write_text(forced)
    prepare_workspace(repo)
    root = Path(__file__).resolve().parents[1]
    lockdown = Lockdown(workspace=repo, env={"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}, kept=(root,))
    with PytestServer(prefix=sandboxed([], lockdown)) as server:
        run = server.run(
            repo, ["tests/test_mini.py::test_wrong", "-p", "no:cacheprovider"], ["src"]
        )
    assert run.outcomes == {"tests/test_mini.py::test_wrong": "failed"}
    assert not list(repo.glob("imported-*"))
