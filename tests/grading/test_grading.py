"""Rewards posted by the controller's side (agl/grading/, issue 18): a graded task's
harness holds no report key and sees only its own workspace; the grader's verdict on that
workspace is the reward, whatever the agent tries."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from agl.agent import AgentContext
from agl.backends.execution.confine import Confinement, confined
from agl.backends.execution.local.config import LocalExecutorConfig
from agl.backends.execution.local.executor import LocalExecutor
from agl.core.contracts.failures import Cause, failure_cause
from agl.core.contracts.records import Status
from agl.grading import GRADE_EVENT, Grade, as_grade, load_grader
from agl.sandbox.launch import unavailable
from agl.testing.fake_vllm import FakeVllm
from agl.testing.processes import GatewayProcess
from tests.helpers.board import board
from tests.helpers.controller import group_final, new_group, running, specs

REPO = Path(__file__).resolve().parents[2]
GRADER = "tests.helpers.graded_agent:grade"
needs_confinement = pytest.mark.skipif(
    unavailable() is not None, reason=f"cannot confine here: {unavailable()}"
)


@pytest.mark.slow
@needs_confinement
def test_the_grader_sets_the_reward_and_the_agents_cannot(
    gateway: GatewayProcess, fake: FakeVllm, tmp_path: Path
) -> None:
    group = new_group()
    honest, hostile = f"{group}-0", f"{group}-1"
    run_dir = tmp_path / "run"

    async def main(sync: str) -> None:
        store = str(gateway.run_dir / "gateway.db")
        common = {"answer": "42", "sync": sync, "store": store}
        inputs = [{"role": "honest", **common}, {"role": "hostile", "victim": honest, **common}]
        config = LocalExecutorConfig(
            harness=f"command:exec {sys.executable} -m tests.helpers.graded_agent",
            run_dir=run_dir,
            extra_pythonpath=[str(REPO)],
            confine=True,
            hide=[str(gateway.run_dir)],
            grader=GRADER,
        )
        async with running(gateway, LocalExecutor(config)) as (_, client):
            await client.create_rollouts(specs(group, inputs, max_attempts=1))
            # A guard, not a measure: two interpreters and openai's import on busy cores.
            good, bad = await group_final(client, group, 2, timeout_s=300)

            assert good.status is Status.SUCCEEDED, good.error
            rewards = await client.get_events(honest, type="reward")
            # The grader's verdict, with its metrics; not the harness's own 0.5.
            assert [e.data for e in rewards] == [{"value": 1.0, "metrics": {"answer_chars": 2.0}}]
            grades = await client.get_events(honest, type=GRADE_EVENT)
            assert [e.data for e in grades] == [{"answer": "42"}]

            # The hostile agent's answer is a link to the honest one: the grader refuses to
            # follow it out of the workspace, and that is the agent's failure.
            assert bad.status is Status.FAILED
            assert bad.error is not None and bad.error.startswith("grader raised: ValueError")
            assert "leads out of the attempt's workspace" in bad.error
            cause = failure_cause(bad.status, bad.error, has_reward=False)
            assert cause is Cause.GRADER and cause.agent
            assert await client.get_events(hostile, type="reward") == []

    with board() as (sync, _):
        asyncio.run(main(sync))
    out = {
        rid: json.loads((run_dir / "attempts" / f"{rid}.1.out").read_text())
        for rid in (honest, hostile)
    }
    workspace = run_dir / "workspaces" / f"{honest}.1"
    assert out[honest]["cwd"] == out[honest]["workspace"] == str(workspace)
    tried = out[hostile]
    assert tried["list_run_dir"] == "PermissionError"  # the run folder: a passage only
    assert tried["read_store"] == "FileNotFoundError"  # not in its view: /tmp is its own
    assert tried["list_workspaces"] == "PermissionError"
    assert tried["overwrite_victim"] == "FileNotFoundError"  # not mounted in its view
    assert (tried["post_reward"], tried["patch_status"]) == ("403", "403")
    assert not (run_dir / "workspaces").exists() or not any((run_dir / "workspaces").iterdir())


@needs_confinement
def test_a_writable_folder_is_the_only_thing_in_sight_of_a_hidden_one(tmp_path: Path) -> None:
    hidden = tmp_path / "run"
    mine, other = hidden / "workspaces" / "a", hidden / "workspaces" / "b"
    for folder in (mine, other):
        folder.mkdir(parents=True)
        (folder / "f").write_text(folder.name)
    (hidden / "store").write_text("secret")
    script = (
        f"cat {mine}/f; echo; echo new > {mine}/g; "
        f"ls {hidden} || echo run:refused; ls {hidden}/workspaces || echo list:refused; "
        f"cat {hidden}/store || echo store:gone; cat {other}/f || echo other:gone"
    )
    env = {"PATH": "/usr/bin:/bin"}
    with confined(["sh", "-c", script], Confinement((hidden,)), env, mine, [mine]) as start:
        done = subprocess.run(start.argv, capture_output=True, text=True, **start.kwargs)
    lines = done.stdout.split()
    assert lines == ["a", "run:refused", "list:refused", "store:gone", "other:gone"]
    assert (mine / "g").read_text() == "new\n"  # written through to the real folder
    assert (other / "f").read_text() == "b"


def test_a_grade_is_a_grade_or_a_number() -> None:
    assert as_grade(0.5) == Grade(reward=0.5)
    assert as_grade(1) == Grade(reward=1.0)
    for bad in (True, "1", None):
        with pytest.raises(ValueError, match="returns a Grade or a number"):
            as_grade(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="finite"):
        Grade(reward=float("nan"))


def test_a_grader_must_be_async_and_needs_a_command_harness(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not an async function"):
        load_grader("tests.helpers.graded_agent:main")
    with pytest.raises(ValueError, match="needs a command: harness"):
        LocalExecutorConfig(harness="tests.x:run", run_dir=tmp_path, grader=GRADER)


def test_a_graded_harness_reports_nothing_itself() -> None:
    agent = AgentContext(
        gateway_url="http://127.0.0.1:9",  # nothing listens: a post would fail
        rollout_id="r",
        attempt=1,
        mode="train",
        model="policy",
        api_key="agl-x",
        input={},
        graded=True,
    )
    asyncio.run(agent.finish(reward=1.0))
