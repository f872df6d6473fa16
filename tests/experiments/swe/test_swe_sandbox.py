"""experiments/swe's sandbox, warm pytest and grader, each on its own: what a command in
the jail can and cannot reach, the forked pytest's outcomes and timeout, the grader's
restoring of tests and SWE-smith's verdict, and the attacks on each (issue 43): a linked
package folder, forged outcomes, an installed clean copy, a flood of output, IPC left for
the next attempt, a fork bomb, a venv inside the checkout."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from agl.sandbox.jail import SITE, sealed
from agl.sandbox.launch import Finished, run, unavailable
from agl.sandbox.uids import give, lease
from experiments.swe.canaries import NodeId, plant
from experiments.swe.grader import carry_over, reaches_into_the_runner, read_inside
from experiments.swe.harness import hidden_from_agents
from experiments.swe.sandbox import (
    GIT_REFUSED,
    OUTPUT_LIMIT,
    ROOT,
    SandboxUnavailable,
    check_project,
    tool_jail,
)
from experiments.swe.testrun import PytestServer, SuiteRun, verdict
from tests.helpers.forged_outcomes import CONCATENATED, FRAME_WALK

needs_namespaces = pytest.mark.skipif(
    unavailable() is not None, reason=f"no namespaces here: {unavailable()}"
)
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="a uid of its own needs root")

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


        class TestKind:
            def test_method(self):
                assert add(2, 2) == 5
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
            "tests/test_mini.py::TestKind::test_method": "failed",
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


def test_a_source_reached_through_a_linked_folder_is_missing(tmp_path: Path) -> None:
    """H1: the package folder replaced by a link to the clean copy (the mirror's): the
    grader, which runs outside the jail as root, must not read the clean code through it."""
    branch, repo, clean = tmp_path / "branch", tmp_path / "repo", tmp_path / "mirror"
    for root, text in ((branch, "x = 1\n"), (repo, "x = 1\n"), (clean, "x = 2\n")):
        (root / "src" / "pkg").mkdir(parents=True)
        (root / "src" / "pkg" / "code.py").write_text(text)
    shutil.rmtree(repo / "src" / "pkg")
    (repo / "src" / "pkg").symlink_to(clean / "src" / "pkg")
    assert (repo / "src" / "pkg" / "code.py").read_text() == "x = 2\n"  # as root reads it
    assert read_inside(repo, "src/pkg/code.py") is None
    assert carry_over(branch, repo, ["src/pkg/code.py"]).missing == ("src/pkg/code.py",)
    (repo / "src").rename(tmp_path / "elsewhere")  # a link one folder higher
    (repo / "src").symlink_to(clean / "src")
    assert carry_over(branch, repo, ["src/pkg/code.py"]).missing == ("src/pkg/code.py",)
    # A hard link to a file elsewhere, or a pipe, is no source file either.
    (repo / "src").unlink()
    (repo / "src" / "pkg").mkdir(parents=True)
    os.link(clean / "src" / "pkg" / "code.py", repo / "src" / "pkg" / "code.py")
    assert read_inside(repo, "src/pkg/code.py") is None
    os.unlink(repo / "src" / "pkg" / "code.py")
    os.mkfifo(repo / "src" / "pkg" / "code.py")
    assert read_inside(repo, "src/pkg/code.py") is None  # and it did not block
    assert read_inside(branch, "src/pkg/code.py") == b"x = 1\n"


def _in_jail(workspace: Path, command: str, **options: object) -> tuple[Finished, int | None]:
    with lease() as uid:
        give(workspace, uid)
        spec = tool_jail(workspace, **options).spec(["bash", "-c", command], uid, OUTPUT_LIMIT)  # type: ignore[arg-type]
        return run(spec, timeout_s=120), uid


@needs_namespaces
def test_a_command_runs_as_its_own_user_in_its_workspace_with_nothing_else_in_reach(
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
    done, uid = _in_jail(
        workspace,
        "id -u; cat mine.txt; echo; touch new.txt && echo wrote; "
        f"cat {secret}/fix.py || echo sealed; cat {single} || echo covered; "
        "ls /tmp | wc -l; env; git status || true; "
        "python -c \"import urllib.request as u; u.urlopen('http://1.1.1.1', timeout=3)\" "
        "|| echo offline; touch /usr/local/x || echo readonly; "
        f"touch {Path(sys.base_prefix) / 'tampered'} || echo interpreter-readonly; "
        f"ls {Path.home() / '.cache'} || echo no-home; ls /srv /work || echo nothing-else; "
        "python -m pip --version || echo no-pip; tr '\\0' ' ' < /proc/1/cmdline",
        hidden=(secret, single),
    )
    out = done.output
    expected_uid = os.geteuid() if uid is None else uid
    assert out.startswith(f"{expected_uid}\nmine\nwrote\n"), out
    for said in ("sealed", "covered", "offline", "readonly", "interpreter-readonly"):
        assert f"\n{said}\n" in out, (said, out)
    for said in ("no-home", "nothing-else", "no-pip"):
        assert f"\n{said}\n" in out, (said, out)
    assert not (Path(sys.base_prefix) / "tampered").exists()
    assert "the fix" not in out
    assert "AGL_" not in out and "KEY" not in out  # nothing of the harness's environment
    assert GIT_REFUSED in out
    # H1's first step: the sandbox's spec is on no command line, so nothing hidden is named.
    assert str(secret) not in out.split("readonly", 1)[1] and "hidden" not in out
    assert (workspace / "new.txt").exists()  # written through to the real folder


@needs_namespaces
def test_no_installed_package_is_in_reach_of_a_command(tmp_path: Path) -> None:
    """H3: a clean copy of the project may be installed in any interpreter (this machine's
    image has the xmltodict release a task is made from). Every site folder is sealed:
    only pytest and what it requires are importable, from the jail's own folder."""
    import yaml  # an installed package no task needs: it stands in for the project

    module = Path(yaml.__file__)
    workspace = tmp_path / "ws"
    workspace.mkdir()
    done, _ = _in_jail(
        workspace,
        "python -c 'import yaml' 2>&1 | tail -1; "
        f"cat {module} > /dev/null || echo sealed-file; "
        f"ls {module.parent.parent} || echo sealed; "
        "python -c 'import pytest, sys; print(pytest.__file__)'",
    )
    assert "No module named 'yaml'" in done.output, done.output
    assert "sealed-file" in done.output and "\nsealed\n" in done.output, done.output
    assert f"{SITE}/pytest/__init__.py" in done.output or f"{SITE}/pytest" in done.output
    assert module.parent.parent.as_posix() in sealed() or any(
        module.is_relative_to(p) for p in sealed()
    )


def test_a_project_the_test_runner_needs_cannot_be_a_task() -> None:
    check_project(["schema", "xmltodict"])
    with pytest.raises(SandboxUnavailable, match="pluggy"):
        check_project(["pluggy"])


@needs_namespaces
def test_a_flood_of_output_costs_the_harness_a_bounded_read(tmp_path: Path) -> None:
    """M1: 200 MB of output reaches the harness as at most ``OUTPUT_LIMIT`` bytes, the
    head and the tail, with how much was left out between them."""
    from experiments.swe.environment import SandboxEnvironment

    workspace = tmp_path / "ws"
    workspace.mkdir()
    with lease() as uid:
        give(workspace, uid)
        environment = SandboxEnvironment(cwd=str(workspace), uid=uid, timeout=120)
        out = environment.execute(
            {"command": "echo first; head -c 200000000 /dev/zero | tr '\\0' x; echo; echo last"}
        )
    assert out["returncode"] == 0
    assert len(out["output"]) < OUTPUT_LIMIT + 200
    assert out["output"].startswith("first\n") and out["output"].rstrip().endswith("last")
    assert "bytes of output left out" in out["output"]


@needs_namespaces
def test_nothing_of_one_jails_ipc_or_name_reaches_the_next(tmp_path: Path) -> None:
    """M2: a SysV shared memory segment made in one jail is not there in the next."""
    workspace = tmp_path / "ws"
    workspace.mkdir()
    made, _ = _in_jail(workspace, "ipcmk -M 4096 && ipcs -m | grep -c 0x; hostname")
    assert "Shared memory id" in made.output and made.output.split()[-1] == "sandbox"
    seen, _ = _in_jail(workspace, "ipcs -m | grep -c 0x; hostname sneaky || echo refused")
    assert seen.output.split()[0] == "0", seen.output
    assert "refused" in seen.output
    assert not subprocess.run(["ipcs", "-m"], capture_output=True, text=True).stdout.count(
        str(os.getpid())
    )


@needs_namespaces
@pytest.mark.parametrize(
    ("command", "limit"),
    [
        (":(){ :|:& };: ; sleep 60", "processes"),
        (
            "for i in 1 2 3 4; do python -c 'x = bytearray(700 << 20); import time; "
            "time.sleep(60)' & done; wait",
            "memory",
        ),
        ("for i in $(seq 8); do head -c 100000000 /dev/zero > f$i; done; sleep 60", "disk"),
    ],
)
def test_a_command_past_a_limit_ends_the_agents_run_saying_which(
    tmp_path: Path, command: str, limit: str
) -> None:
    """M3: a fork bomb, memory past the jail's share and files past its disk end the run
    (mini-swe-agent's exit status SandboxLimit) with the limit named."""
    from minisweagent.exceptions import InterruptAgentFlow

    from experiments.swe.environment import SANDBOX_LIMIT, SandboxEnvironment

    workspace = tmp_path / "ws"
    workspace.mkdir()
    with lease() as uid:
        give(workspace, uid)
        environment = SandboxEnvironment(cwd=str(workspace), uid=uid, timeout=240)
        with pytest.raises(InterruptAgentFlow) as ended:
            environment.execute({"command": command})
    (message,) = ended.value.messages
    assert message["extra"]["exit_status"] == SANDBOX_LIMIT
    assert f"sandbox's {limit} limit" in message["content"], message
    assert not list(workspace.glob("f*")) or limit == "disk"


def _jailed_tests(repo: Path, **options: object) -> PytestServer:
    return PytestServer(
        tool_jail(repo, env={"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}, writable=False, **options)  # type: ignore[arg-type]
    )


@needs_namespaces
def test_the_tests_run_in_the_jail_through_the_warm_pytest(tmp_path: Path) -> None:
    repo = _project(tmp_path / "repo")
    with lease() as uid, _jailed_tests(repo) as server:
        server._uid = uid
        run = server.run(repo, ["tests/test_mini.py::test_add", "-p", "no:cacheprovider"], ["src"])
    assert run.outcomes == {"tests/test_mini.py::test_add": "passed"}


@needs_namespaces
def test_what_the_agent_leaves_in_the_repository_never_runs_in_the_reporting_process(
    tmp_path: Path,
) -> None:
    """A sitecustomize.py or a pytest.py in the repository (the jail starts the server
    there) would run before any test and could rewrite every outcome."""
    repo = _project(tmp_path / "repo")
    forced = (
        "import _pytest.reports as r\n"
        "r.TestReport.outcome = property(lambda self: 'passed', lambda self, v: None)\n"
        "open('/tmp/imported-' + __name__, 'w').close()\n"
    )
    (repo / "sitecustomize.py").write_text(forced)
    (repo / "pytest.py").write_text(forced)
    with _jailed_tests(repo) as server:
        run = server.run(
            repo, ["tests/test_mini.py::test_wrong", "-p", "no:cacheprovider"], ["src"]
        )
    assert run.outcomes == {"tests/test_mini.py::test_wrong": "failed"}


@needs_namespaces
@pytest.mark.parametrize("forger", ["frames", "concatenated"])
def test_forged_outcomes_contradict_the_tests_the_grader_planted(
    tmp_path: Path, forger: str
) -> None:
    """H2: each forgery turns the failing tests into passes on the reporting channel
    (the control: without the planted tests it would earn the reward), and is caught by
    the tests the grader planted."""
    repo = _project(tmp_path / "repo")
    f2p = ["tests/test_mini.py::test_wrong", "tests/test_mini.py::TestKind::test_method"]
    source = repo / "src" / "mini" / "__init__.py"
    if forger == "frames":
        wanted = f"WANTED = {f2p!r}\n"
        source.write_text(source.read_text() + wanted + FRAME_WALK + "_forge()\n")
        assert reaches_into_the_runner(f"+{FRAME_WALK}") is None  # the words miss it
    else:
        source.write_text(source.read_text() + CONCATENATED)
        assert reaches_into_the_runner(f"+{CONCATENATED}") is None
    plain = tmp_path / "plain"
    shutil.copytree(repo, plain)
    with _jailed_tests(plain) as server:
        forged = server.run(plain, [*f2p, "-p", "no:cacheprovider"], ["src"])
    assert all(forged.outcomes.get(t) == "passed" for t in f2p), forged.outcomes
    canaries = plant(repo, f2p)
    with _jailed_tests(repo) as server:
        run = server.run(repo, [*f2p, *canaries.node_ids, "-p", "no:cacheprovider"], ["src"])
    assert canaries.forged(run.outcomes) is not None, run.outcomes


@needs_namespaces
def test_an_honest_run_agrees_with_the_tests_the_grader_planted(tmp_path: Path) -> None:
    repo = _project(tmp_path / "repo")
    f2p = [
        "tests/test_mini.py::test_add",
        "tests/test_mini.py::test_param[2]",
        "tests/test_mini.py::TestKind::test_method",
        "tests/test_mini.py::test_gone",
    ]
    canaries = plant(repo, f2p, nonce="n0")
    assert canaries.guard == "tests/test_mini.py::test_n0_guard"
    assert canaries.copies["tests/test_mini.py::TestKind::test_n0_2"] == f2p[2]
    assert canaries.copies["tests/test_mini.py::test_n0_1[2]"] == f2p[1]
    # A test that is not there has no copy either (pytest refuses a run naming one).
    planted = [t for t in canaries.node_ids if not t.endswith("test_n0_3")]
    with _jailed_tests(repo) as server:
        run = server.run(repo, [*f2p[:3], *planted, "-p", "no:cacheprovider"], ["src"])
    assert run.outcomes["tests/test_mini.py::test_n0_0"] == "passed"
    assert run.outcomes["tests/test_mini.py::test_n0_1[2]"] == "failed"
    assert canaries.forged({**run.outcomes, "tests/test_mini.py::test_gone": "?"}) is not None
    assert canaries.forged(run.outcomes) is None, run.outcomes


def test_what_counts_as_forged() -> None:
    canaries = plant_free(copies={"c": "o"}, guard="g")
    assert canaries.forged({"o": "passed", "c": "passed", "g": "failed"}) is None
    assert "copy" in (canaries.forged({"o": "passed", "c": "failed", "g": "failed"}) or "")
    assert "copy" in (canaries.forged({"o": "passed", "g": "failed"}) or "")
    assert "must fail" in (canaries.forged({"o": "passed", "c": "passed", "g": "passed"}) or "")
    assert "not reported" in (canaries.forged({"o": "passed", "c": "passed"}) or "")
    assert NodeId.parse("doc.txt::x") is None and NodeId.parse("a.py") is None
    assert NodeId.parse("../a.py::t") is None and NodeId.parse("/a.py::t") is None
    assert NodeId.parse("a.py::T::t[x::y]") == NodeId("a.py", ("T",), "t", "[x::y]")


def plant_free(copies: dict[str, str], guard: str):  # type: ignore[no-untyped-def]
    from experiments.swe.canaries import Canaries

    return Canaries(copies, guard)


@needs_namespaces
def test_a_venv_inside_the_checkout_still_runs_the_tests(tmp_path: Path) -> None:
    """M4: the trainer's interpreter in a ``.venv`` inside a checkout the jail seals (agl's,
    as most people make one): the tests still run, from the jail's own Python."""
    checkout = tmp_path / "checkout"
    venv = checkout / ".venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(venv)],
        check=True,
    )
    repo = _project(tmp_path / "repo")
    script = (
        "import sys; from pathlib import Path; sys.path.insert(0, sys.argv[1]);"
        "from experiments.swe.sandbox import tool_jail;"
        "from experiments.swe.testrun import PytestServer;"
        "repo = Path(sys.argv[2]);"
        "jail = tool_jail(repo, hidden=[Path(sys.argv[3])], writable=False,"
        " env={'PYTEST_DISABLE_PLUGIN_AUTOLOAD': '1'});"
        "server = PytestServer(jail);"
        "print(sys.prefix, server.run(repo, ['tests/test_mini.py::test_add',"
        " '-p', 'no:cacheprovider'], ['src']).outcomes); server.close()"
    )
    done = subprocess.run(
        [str(venv / "bin" / "python"), "-c", script, str(ROOT), str(repo), str(checkout)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert str(venv) in done.stdout
    assert "'tests/test_mini.py::test_add': 'passed'" in done.stdout, done.stdout


def test_the_run_folder_is_hidden_in_the_local_layout_and_nothing_above_a_pods_workspace(
    tmp_path: Path,
) -> None:
    mirror = tmp_path / "data" / "mirror"
    local = tmp_path / "run" / "workspaces" / "r.1"
    assert hidden_from_agents(mirror, local) == [tmp_path / "data", tmp_path / "run", ROOT]
    # A Job's workspace is a volume of its pod's: hiding what is above it would hide "/".
    assert hidden_from_agents(mirror, Path("/agl/workspace")) == [tmp_path / "data", ROOT]
