"""Confined local agents own nothing of the trainer's (issue 43, C1; M7's environment).

A scripted attack (tests/helpers/confine_attack.py) runs as a command harness and as a Python
harness through the real local executor and gateway, confined as ``agl.train`` confines
agents: it tries to plant a ``.pth`` file in the interpreter's site-packages (which the
next confinement's privileged helper would have run), change agl's code, write
``core_pattern`` and ``/etc/passwd``, list the trainer's caches and the run folder, read
the sandbox's spec from ``/proc/1/cmdline``, and find the trainer's secrets in its
environment. Every try is refused, for a root trainer (the agent runs as a uid of its
own) and for an unprivileged one that owns its interpreter (the tree is read-only); and
the helper that builds the confinement runs nothing of site-packages.
"""

from __future__ import annotations

import asyncio
import json
import os
import site
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import agl
from agl.backends.execution.local.config import LocalExecutorConfig
from agl.backends.execution.local.executor import LocalExecutor
from agl.sandbox.launch import unavailable
from agl.testing.fake_vllm import FakeVllm
from agl.testing.processes import GatewayProcess
from tests.helpers.confine_attack import PROBE
from tests.helpers.controller import group_final, new_group, running, specs

REPO = Path(__file__).resolve().parents[3]
CHECKOUT = Path(agl.__file__).resolve().parents[1]
NAMES = {"pth", "code", "core", "passwd", "cache", "run", "uid", "cmdline", "env"}
needs_confinement = pytest.mark.skipif(
    unavailable() is not None, reason=f"cannot confine here: {unavailable()}"
)


def tried(output: str) -> dict[str, str]:
    """Each try's answer, by name (``pth <folder>`` for each site folder)."""
    found = {}
    for line in output.splitlines():
        name, sep, answer = line.partition(": ")
        if (sep and name.startswith(("pth", "code", "core", "passwd", "cache", "run"))) or (
            sep and name in ("uid", "cmdline", "env")
        ):
            found[name] = answer
    return found


def assert_all_refused(seen: dict[str, str], run_dir: Path) -> None:
    pths = {k: v for k, v in seen.items() if k.startswith("pth ")}
    assert pths and set(pths.values()) == {"refused"}, seen
    for name in ("code", "core", "passwd", "cache", "run"):
        assert seen[name] == "refused", (name, seen)
    assert str(run_dir) not in seen["cmdline"] and "--hide" not in seen["cmdline"], seen
    assert seen["env"] == "0", seen  # no WANDB_API_KEY, no AGL_TEST_SECRET
    planted = [p for f in (*site.getsitepackages(), sys.prefix) if (p := Path(f) / PROBE).exists()]
    for path in planted:  # a harmless comment; removed so a failure leaves nothing behind
        path.unlink()
    assert not planted
    assert "tampered" not in (CHECKOUT / "agl" / "__init__.py").read_text()


@needs_confinement
@pytest.mark.parametrize("kind", ["command", "python"])
def test_a_confined_agent_can_change_nothing_the_trainer_runs_or_reads(
    gateway: GatewayProcess,
    fake: FakeVllm,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    kind: str,
) -> None:
    monkeypatch.setenv("WANDB_API_KEY", "a-tracker-key")  # the trainer's, not the agent's
    monkeypatch.setenv("AGL_TEST_SECRET", "the trainer's own")
    run_dir = tmp_path / "run"
    args = [str(CHECKOUT), str(gateway.run_dir), str(Path.home())]
    harness = (
        f"command:exec {sys.executable} -m tests.helpers.confine_attack {' '.join(args)}"
        if kind == "command"
        else "tests.helpers.confine_attack:run"
    )
    group = new_group()

    async def main() -> None:
        config = LocalExecutorConfig(
            harness=harness,
            run_dir=run_dir,
            extra_pythonpath=[str(REPO)],
            confine=True,
            hide=[str(gateway.run_dir)],
        )
        async with running(gateway, LocalExecutor(config)) as (_, client):
            await client.create_rollouts(specs(group, [{"args": args}], max_attempts=1))
            # A guard, not a measure: an interpreter and the attack's shell on busy cores.
            await group_final(client, group, 1, timeout_s=300)

    asyncio.run(main())
    logs = sorted((run_dir / ("attempts" if kind == "command" else "workers")).glob("*"))
    output = "\n".join(p.read_text(errors="replace") for p in logs)
    seen = tried(output)
    assert_all_refused(seen, gateway.run_dir)
    if os.geteuid() == 0:  # a uid of its own: not root's, not anyone's the trainer uses
        assert int(seen["uid"]) >= 1_000_000, seen


@needs_confinement
def test_an_unprivileged_trainer_that_owns_its_interpreter_is_safe_too(tmp_path: Path) -> None:
    """A trainer of its own user, owning the interpreter and agl's checkout (emulated: a
    user namespace whose uid 1000 is the files' owner, without any privilege): its
    agents run as that user, so only the read-only tree stands between them and it.
    The control: the trainer itself can write where its agent cannot."""
    script = textwrap.dedent(
        """
        import os, site, subprocess, sys
        from pathlib import Path
        from agl.backends.execution.confine import Confinement, code_paths, confined
        from tests.helpers.confine_attack import SCRIPT
        folder = Path(site.getsitepackages()[0])
        probe = folder / "agl-confine-control.txt"
        probe.write_text("the trainer owns its site-packages")
        probe.unlink()
        print("trainer:", os.geteuid(), "wrote", folder)
        run, home = Path(sys.argv[1]), Path.home()
        argv = ["sh", "-c", SCRIPT, "attack", sys.argv[2], str(run), str(home)]
        env = {"PATH": os.environ["PATH"], "WANDB_API_KEY": "x"}
        confinement = Confinement((run,), tuple(code_paths([])))
        with confined(argv, confinement, {"PATH": env["PATH"]}, Path("/")) as start:
            done = subprocess.run(start.argv, capture_output=True, text=True, **start.kwargs)
        print(done.stdout, done.stderr)
        """
    )
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    unprivileged = ["unshare", "--user", "--map-user=1000", "--map-group=1000"]
    done = subprocess.run(
        [*unprivileged, sys.executable, "-c", script, str(run_dir), str(CHECKOUT)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert done.returncode == 0, done.stderr
    assert "trainer: 1000 wrote" in done.stdout, done.stdout
    seen = tried(done.stdout)
    assert_all_refused(seen, run_dir)


@needs_confinement
def test_the_helper_that_builds_the_confinement_runs_nothing_of_site_packages(
    tmp_path: Path,
) -> None:
    """The namespace's first process holds every privilege while it builds the tree: a
    ``.pth`` file in the interpreter's site-packages (planted by anyone who could write
    there) must not run in it. A venv stands in for the trainer's interpreter; the
    control shows its ``.pth`` runs at an ordinary start."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    (site_folder,) = venv.glob("lib/python3*/site-packages")
    marker = tmp_path / "ran"
    (site_folder / "zz-plant.pth").write_text(
        f"import sys; open({str(marker)!r}, 'a').write(repr(sys.argv) + chr(10))\n"
    )
    subprocess.run([str(python), "-c", "pass"], check=True)
    assert marker.exists()  # the control: an ordinary start runs it
    marker.unlink()
    script = (
        "from agl.sandbox.launch import run; from agl.sandbox.spec import Spec;"
        "done = run(Spec(view='host', argv=('true',), cwd='/', env={'PATH': '/usr/bin:/bin'}),"
        " 60); print(done.exit, done.status)"
    )
    done = subprocess.run(
        [str(python), "-c", script],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=120,
    )
    assert done.stdout.startswith("0 "), (done.stdout, done.stderr)
    # The venv's python ran the .pth for the script (as often as its site folder is on
    # the path), never for the helper.
    ran = marker.read_text().splitlines()
    assert ran and set(ran) == {"['-c']"}, ran


def test_an_agents_environment_is_a_whitelist() -> None:
    from agl.backends.execution.confine import agent_env

    trainer = {
        "PATH": "/bin",
        "LANG": "C.UTF-8",
        "LC_ALL": "C",
        "WANDB_API_KEY": "k",
        "AGL_ADMIN_TOKEN": "t",
        "HF_TOKEN": "h",
        "AWS_SECRET_ACCESS_KEY": "a",
        "PYTHONPATH": "/x",
        "MY_SETTING": "m",
    }
    env = agent_env({"AGL_ROLLOUT_ID": "r"}, ["/repo"], ["MY_SETTING"], source=trainer)
    assert env == {
        "PATH": "/bin",
        "LANG": "C.UTF-8",
        "LC_ALL": "C",
        "PYTHONPATH": "/repo:/x",
        "MY_SETTING": "m",
        "AGL_ROLLOUT_ID": "r",
    }
    assert json.dumps(env).count("KEY") == 0
