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
from experiments.swe.grader import carry_over, reaches_into_the_runner
from experiments.swe.harness import hidden_from_agents
from experiments.swe.sandbox import (
    NOBODY,
    ROOT,
    Lockdown,
    installed_copies,
    prepare_workspace,
    sandboxed,
)
from experiments.swe.sandbox_entry import GIT_REFUSED
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


def test_only_the_agents_sources_are_carried_over_to_a_fresh_checkout(tmp_path: Path) -> None:
    branch, repo = tmp_path / "branch", tmp_path / "repo"
    for root in (branch, repo):
        (root / "tests").mkdir(parents=True)
        (root / "tests" / "test_a.py").write_text("def test_a():\n    assert False\n")
        (root / "pyproject.toml").write_text("[tool.pytest.ini_options]\n")
        (root / "src" / "pkg").mkdir(parents=True)
        (root / "src" / "pkg" / "code.py").write_text("x = 1\n")
        (root / "src" / "pkg" / "other.py").write_text("y = 1\n")
    (repo / "tests" / "test_a.py").write_text("def test_a():\n    pass\n")  # edited
    (repo / "tests" / "conftest.py").write_text("# decides what passes\n")  # added
    (repo / "json.py").write_text("# shadows the standard library\n")
    (repo / "pyproject.toml").unlink()
    (repo / "pyproject.toml").symlink_to("/etc/hostname")
    (repo / "src" / "pkg" / "code.py").write_text("x = 2\n")  # the fix
    (repo / "src" / "pkg" / "__pycache__").mkdir()
    (repo / "src" / "pkg" / "__pycache__" / "code.cpython-311.pyc").write_bytes(b"stale")
    change = carry_over(branch, repo, ["src/pkg/code.py", "src/pkg/other.py"])
    assert change.changed == ("src/pkg/code.py",) and change.missing == ()
    assert change.ignored == ("json.py", "pyproject.toml", "tests/conftest.py", "tests/test_a.py")
    assert (branch / "src" / "pkg" / "code.py").read_text() == "x = 2\n"
    assert (branch / "tests" / "test_a.py").read_text() == "def test_a():\n    assert False\n"
    assert not (branch / "json.py").exists() and not (branch / "tests" / "conftest.py").exists()
    assert "+x = 2" in change.diff


def test_a_deleted_or_linked_source_is_missing(tmp_path: Path) -> None:
    branch, repo = tmp_path / "branch", tmp_path / "repo"
    for root in (branch, repo):
        root.mkdir()
        (root / "a.py").write_text("a = 1\n")
        (root / "b.py").write_text("b = 1\n")
    (repo / "a.py").unlink()  # the tests would import an installed copy
    (repo / "b.py").unlink()
    (repo / "b.py").symlink_to(tmp_path / "elsewhere.py")
    assert carry_over(branch, repo, ["a.py", "b.py"]).missing == ("a.py", "b.py")


@pytest.mark.parametrize(
    ("line", "named"),
    [
        ("import _pytest.reports as r", "_pytest"),
        ("sys.modules['json'] = fake", "sys.modules"),
        ("os._exit(0)", "os._exit"),
        ("open('/proc/1/fd/1', 'w')", "/proc"),
        ("__builtins__['open'] = f", "__builtins__"),
    ],
)
def test_a_change_that_reaches_into_the_test_runner_is_refused(line: str, named: str) -> None:
    diff = f"--- a/x.py\n+++ b/x.py\n@@ -1 +1,2 @@\n x = 1\n+{line}\n"
    assert reaches_into_the_runner(diff) == named
    assert reaches_into_the_runner("--- a/x.py\n+++ b/x.py\n-import sys.modules\n+x = 2\n") is None


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
    copies = installed_copies(["_pytest"])  # any installed package stands in for one
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


def test_the_run_folder_is_hidden_in_the_local_layout_and_nothing_above_a_pods_workspace(
    tmp_path: Path,
) -> None:
    mirror = tmp_path / "data" / "mirror"
    local = tmp_path / "run" / "workspaces" / "r.1"
    assert hidden_from_agents(mirror, local) == [tmp_path / "data", tmp_path / "run", ROOT]
    # A Job's workspace is a volume of its pod's: hiding what is above it would hide "/".
    assert hidden_from_agents(mirror, Path("/agl/workspace")) == [tmp_path / "data", ROOT]
