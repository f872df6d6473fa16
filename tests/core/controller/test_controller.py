"""The controller loop and LocalExecutor against a real gateway on loopback.

Harnesses: tests/helpers/controller_harnesses.py (run by worker processes, imported from the repo
root) and small command scripts written under tmp_path.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from agl.agent import AgentContext
from agl.backends.execution.local.config import LocalExecutorConfig
from agl.backends.execution.local.executor import LocalExecutor
from agl.core.client import AsyncGatewayClient, GatewayClient
from agl.core.contracts.execution import LOST, NO_STATUS, ORPHANED, STOPPED, Exit, Launch
from agl.core.contracts.records import Rollout, Status
from agl.core.controller.reconcile import Controller
from agl.testing.processes import GatewayProcess, free_port, gateway_process
from tests.helpers.controller import group_final, new_group, running, specs, wait_until

REPO = Path(__file__).resolve().parents[3]
HARNESSES = "tests.helpers.controller_harnesses"


def executor(tmp_path: Path, harness: str, **options: Any) -> LocalExecutor:
    config = LocalExecutorConfig(
        harness=harness, run_dir=tmp_path / "run", extra_pythonpath=[str(REPO)], **options
    )
    return LocalExecutor(config)


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


async def seen_keys(client: AsyncGatewayClient, rollouts: list[Rollout]) -> list[str]:
    events = await asyncio.gather(*(client.get_events(r.rollout_id, type="seen") for r in rollouts))
    assert all(e.data["pool"] for batch in events for e in batch), "harness lacked the pool"
    return [e.data["key"] for batch in events for e in batch]


# -- python harness through the controller ----------------------------------------------


def test_python_harness_runs_every_rollout(gateway: GatewayProcess, tmp_path: Path) -> None:
    group = new_group()
    inputs = [{"reward": i / 10} for i in range(12)]

    async def main() -> None:
        ex = executor(tmp_path, f"python:{HARNESSES}:reward_from_input", concurrency=4)
        async with running(gateway, ex) as (controller, client):
            await client.create_rollouts(specs(group, inputs))
            rollouts = await group_final(client, group, len(inputs))
            assert [r.status for r in rollouts] == [Status.SUCCEEDED] * len(inputs)
            assert [r.attempt for r in rollouts] == [1] * len(inputs)
            for r, data in zip(rollouts, inputs, strict=True):
                (reward,) = await client.get_events(r.rollout_id, type="reward")
                assert reward.data == {"value": data["reward"]}
            keys = await seen_keys(client, rollouts)
            assert len(keys) == len(set(keys)) == len(inputs)
            await wait_until(lambda: controller.stats.exited_ok == len(inputs))
            assert controller.stats.launched == len(inputs)
            assert controller.stats.requeued == controller.stats.agent_failed == 0

    asyncio.run(main())
    logs = "".join(p.read_text() for p in (tmp_path / "run" / "workers").glob("*.log"))
    assert f"rollout {group}-0 done" in logs  # harness prints go to the worker log


def test_failures_retries_and_stats(gateway: GatewayProcess, tmp_path: Path) -> None:
    """No status, raise, hang: the agent's failures, final at once with their reason (a
    learning signal, not retried). Lucky-on-the-second-attempt: the gateway unreachable
    on the first, an infrastructure failure, re-queued while attempts remain. Each
    counted."""
    group = new_group()
    plan = [  # (input, max_attempts, timeout_s)
        ({"do": "finish"}, 1, None),
        ({"do": "none"}, 2, None),
        ({"do": "none"}, 2, None),
        ({"do": "raise"}, 1, None),
        ({"do": "hang"}, 2, 1.0),
        ({"do": "lucky"}, 3, None),
        ({"do": "lucky"}, 3, None),
    ]
    batch = [
        {"rollout_id": f"{group}-{i}", "group_id": group, "input": data, "max_attempts": m}
        | ({} if t is None else {"timeout_s": t})
        for i, (data, m, t) in enumerate(plan)
    ]

    async def main() -> None:
        ex = executor(tmp_path, f"{HARNESSES}:by_input", workers=1)
        async with running(gateway, ex) as (controller, client):
            await client.create_rollouts(batch)
            rollouts = await group_final(client, group, len(plan))
            ok, none1, none2, raised, hung, lucky1, lucky2 = rollouts
            assert (ok.status, ok.attempt) == (Status.SUCCEEDED, 1)
            for r in (none1, none2):
                assert (r.status, r.attempt, r.error) == (Status.FAILED, 1, NO_STATUS)
            assert (raised.status, raised.error) == (Status.FAILED, "ValueError: the input is bad")
            assert (hung.status, hung.attempt) == (Status.FAILED, 1)
            # The gateway's own timeout sweep may fail it a moment before the worker does.
            assert hung.error in ("timed out after 1 s", "attempt timed out")
            for r in (lucky1, lucky2):
                assert (r.status, r.attempt) == (Status.SUCCEEDED, 2)
            keys = await seen_keys(client, [ok, none1, none2, lucky1, lucky2])
            assert len(keys) == len(set(keys)) == 1 + 1 + 1 + 2 + 2  # one key per attempt
            expected = {
                "launched": 1 + 1 + 1 + 1 + 1 + 2 + 2,
                "exited_ok": 3,
                "exited_without_status": 1 + 1,
                "agent_failed": 1 + 1 + 1 + 1,  # raised, hung, both lucky first attempts
                "requeued": 1 + 1,
                "given_up": 1 + 1 + 1 + 1,
                "agent_final": 1 + 1 + 1,  # none, none, hung: attempts left, not retried
                "lost": 0,
                "orphans_stopped": 0,
            }
            await wait_until(lambda: vars(controller.stats) == expected, 5)

    asyncio.run(main())


@pytest.mark.slow
def test_a_flooding_agent_is_throttled_alone_and_a_reward_counts_once(
    gateway: GatewayProcess, tmp_path: Path
) -> None:
    """Through the controller: one agent fires 400 calls at once at its proxy while
    another makes 20 in a row; the flooder gets 429s past its burst, the other none. An
    agent that reports its reward twice has it stored once (the first)."""
    group = new_group()
    plan = [{"do": "flood", "n": 400}, {"do": "calls", "n": 20}, {"do": "reward_twice"}]

    async def main() -> None:
        ex = executor(tmp_path, f"{HARNESSES}:by_input", workers=1)
        async with running(gateway, ex) as (_, client):
            await client.create_rollouts(specs(group, plan))
            flood, polite, twice = await group_final(client, group, len(plan))
            assert [r.status for r in (flood, polite, twice)] == [Status.SUCCEEDED] * 3, [
                (r.status, r.attempt, r.error) for r in (flood, polite, twice)
            ]
            (flooded,) = await client.get_events(flood.rollout_id, type="calls")
            (calm,) = await client.get_events(polite.rollout_id, type="calls")
            statuses = flooded.data["statuses"]
            assert set(statuses) == {200, 429} and len(statuses) == 400
            assert 100 <= statuses.count(200) < 400  # the burst, and what refilled meanwhile
            assert calm.data["statuses"] == [200] * 20
            rewards = await client.get_events(twice.rollout_id, type="reward")
            assert [e.data["value"] for e in rewards] == [0.25]

    asyncio.run(main())


def test_killed_worker_attempts_are_retried(gateway: GatewayProcess, tmp_path: Path) -> None:
    group = new_group()
    n = 16
    go = tmp_path / "go"  # no attempt finishes before it exists: the victim's are running
    victim_log = tmp_path / "run" / "workers" / "worker-0.log"

    def readies() -> int:
        return victim_log.read_text().count("ready: harness")

    async def main() -> None:
        ex = executor(tmp_path, f"{HARNESSES}:by_input", workers=2, concurrency=16)
        async with running(gateway, ex) as (controller, client):
            await client.create_rollouts(
                specs(group, [{"do": "finish", "until": str(go)}] * n, max_attempts=2)
            )
            await wait_until(lambda: controller.stats.launched == n)
            victim, survivor = ex.pids()
            os.kill(victim, signal.SIGKILL)
            go.touch()
            rollouts = await group_final(client, group, n)
            assert all(r.status is Status.SUCCEEDED for r in rollouts)
            retried = sum(r.attempt == 2 for r in rollouts)
            assert 0 < retried < n  # the victim's share, and only it
            assert controller.stats.requeued == controller.stats.agent_failed == retried
            # Restarted: its handshake comes before it logs its ready line.
            await wait_until(lambda: readies() == 2)  # started, restarted
            pids = ex.pids()
            assert len(pids) == 2 and survivor in pids and victim not in pids
        assert not alive(victim)

    asyncio.run(main())
    assert readies() == 2


# -- LocalExecutor on its own -----------------------------------------------------------


def fake_env(rollout_id: str, data: dict[str, Any]) -> dict[str, str]:
    """An attempt's env pointing at no gateway (for harnesses that never call it)."""
    context = AgentContext("http://127.0.0.1:9", rollout_id, 1, "train", "m", "key", data)
    return context.to_env()


async def collect(ex: LocalExecutor, n: int, timeout_s: float = 20.0) -> dict[str, str | None]:
    """Exits until ``n`` came, as rollout id → error."""
    got: dict[str, str | None] = {}

    async def check() -> bool:
        got.update({e.rollout_id: e.error for e in await ex.exits()})
        return len(got) >= n

    await wait_until(check, timeout_s)
    return got


def test_worker_reports_each_outcome_in_one_line(tmp_path: Path) -> None:
    async def main() -> None:
        ex = executor(tmp_path, f"{HARNESSES}:by_input", workers=1, concurrency=8)
        await ex.start()
        try:
            (pid,) = ex.pids()
            assert ex.free_slots == 8
            cases = {
                "raise": ({"do": "raise"}, None),
                "hang": ({"do": "hang"}, 0.5),
                "exit": ({"do": "exit"}, None),
                "idle": ({"do": "idle"}, None),
            }
            for name, (data, timeout_s) in cases.items():
                await ex.launch(Launch(name, 1, timeout_s, fake_env(name, data)))
                await ex.launch(Launch(name, 1, timeout_s, fake_env(name, data)))  # no-op
            assert ex.free_slots == 8 - len(cases)
            assert await collect(ex, len(cases)) == {
                "raise": "ValueError: the input is bad",
                "hang": "timed out after 0.5 s",
                "exit": "SystemExit: 3",
                "idle": None,
            }
            assert ex.pids() == [pid] and ex.free_slots == 8  # sys.exit() did not end it
        finally:
            await ex.close()
        assert not alive(pid)

    asyncio.run(main())
    log = (tmp_path / "run" / "workers" / "worker-0.log").read_text()
    assert "rollout raise attempt 1: harness raised" in log and "Traceback" in log


COMMAND_HARNESS = """\
import json, os, signal, subprocess, sys, time
data = json.loads(os.environ["AGL_INPUT"])
print("rollout", os.environ["AGL_ROLLOUT_ID"], os.environ["OPENAI_BASE_URL"], flush=True)
print("to stderr", file=sys.stderr, flush=True)
print("admin token:", "AGL_ADMIN_TOKEN" in os.environ, flush=True)
if data["do"] == "finish":
    import asyncio
    from agl.agent import AgentContext
    asyncio.run(AgentContext.from_env(os.environ).finish(reward=0.5))
elif data["do"] == "exit":
    sys.exit(3)
elif data["do"] == "signal":
    os.kill(os.getpid(), signal.SIGTERM)
elif data["do"] == "hang":
    child = subprocess.Popen(["sleep", "300"])
    open(data["pidfile"], "w").write(str(child.pid))
    time.sleep(300)
"""


def command_executor(tmp_path: Path, **options: Any) -> LocalExecutor:
    script = tmp_path / "harness.py"
    script.write_text(COMMAND_HARNESS)
    # exec: the shell becomes the script, so a signal that kills it is seen as such
    return executor(tmp_path, f"command:exec {sys.executable} {script}", **options)


def test_command_harness_through_the_controller(
    gateway: GatewayProcess, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    group = new_group()
    monkeypatch.setenv("AGL_ADMIN_TOKEN", gateway.token)  # must not reach an agent

    async def main() -> None:
        ex = command_executor(tmp_path, concurrency=4)
        async with running(gateway, ex) as (_, client):
            inputs = [{"do": "finish"}, {"do": "exit"}, {"do": "signal"}]
            await client.create_rollouts(specs(group, inputs))
            ok, exited, signalled = await group_final(client, group, len(inputs))
            assert ok.status is Status.SUCCEEDED
            (reward,) = await client.get_events(ok.rollout_id, type="reward")
            assert reward.data == {"value": 0.5}
            assert (exited.status, exited.error) == (Status.FAILED, "exit code 3")
            assert (signalled.status, signalled.error) == (
                Status.FAILED,
                "killed by signal SIGTERM",
            )
        attempts = tmp_path / "run" / "attempts"
        out = (attempts / f"{group}-0.1.out").read_text()
        assert f"rollout {group}-0 {gateway.url}/proxy/rollout/{group}-0/attempt/1/" in out
        assert "admin token: False" in out
        assert (attempts / f"{group}-0.1.err").read_text() == "to stderr\n"

    asyncio.run(main())


def test_hanging_command_is_killed_with_its_group(tmp_path: Path) -> None:
    pidfile = tmp_path / "child.pid"

    async def main() -> None:
        ex = command_executor(tmp_path, concurrency=2)
        await ex.start()
        try:
            data = {"do": "hang", "pidfile": str(pidfile)}
            await ex.launch(Launch("hang", 1, 1.0, fake_env("hang", data)))
            assert ex.free_slots == 1
            assert await collect(ex, 1) == {"hang": "timed out after 1 s"}
            assert ex.free_slots == 2
        finally:
            await ex.close()

    asyncio.run(main())
    assert not alive(int(pidfile.read_text()))  # the `sleep` the command started


# -- bad harness strings ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("harness", "message"),
    [
        ("no_colon_here", "is not 'module:function'"),
        ("python:tests.helpers.controller_harnesses:", "is not 'module:function'"),
        ("command:  ", "the command is empty"),
        ("tests.no_such_module:run", "cannot import module 'tests.no_such_module'"),
        (f"{HARNESSES}:missing", "has no 'missing'"),
        (f"{HARNESSES}:not_async", "is not an async function"),
    ],
)
def test_bad_harness_fails_at_start(tmp_path: Path, harness: str, message: str) -> None:
    async def main() -> None:
        ex = executor(tmp_path, harness, workers=1)
        with pytest.raises(ValueError, match=message) as caught:
            await ex.start()
        assert "\n" not in str(caught.value)
        assert ex.pids() == [] and ex.free_slots == 0

    asyncio.run(main())


# -- stopping ---------------------------------------------------------------------------


def test_cancelling_the_controller_leaves_no_process(
    gateway: GatewayProcess, tmp_path: Path
) -> None:
    python_group, command_group = new_group(), new_group()
    pidfiles = [tmp_path / f"child-{i}.pid" for i in range(2)]

    async def hang_then_cancel(
        ex: LocalExecutor, group: str, inputs: list[dict[str, Any]], ready: Callable[[], bool]
    ) -> None:
        pids: list[int] = []
        async with running(gateway, ex) as (controller, client):
            await client.create_rollouts(specs(group, inputs))
            await wait_until(lambda: controller.stats.launched == len(inputs) and ready())
            pids = ex.pids()
            assert pids
        # Cancelled: every process is gone and the attempts it held were failed.
        assert not any(map(alive, pids))
        async with httpx.AsyncClient() as http:
            client = AsyncGatewayClient(gateway.url, gateway.token, http=http)
            for r in await client.list_rollouts(group_id=group):
                assert (r.status, r.error) == (Status.FAILED, STOPPED)

    async def main() -> None:
        python = executor(tmp_path / "py", f"{HARNESSES}:by_input", workers=2)
        await hang_then_cancel(python, python_group, [{"do": "hang"}] * 6, lambda: True)
        command = command_executor(tmp_path, concurrency=4)
        inputs = [{"do": "hang", "pidfile": str(p)} for p in pidfiles]
        await hang_then_cancel(
            command, command_group, inputs, lambda: all(p.exists() for p in pidfiles)
        )

    asyncio.run(main())
    assert not any(alive(int(p.read_text())) for p in pidfiles)


class ScriptedExecutor:
    """An Executor with no slots whose exits the test hands in."""

    free_slots = 0
    detached = False

    def __init__(self, exits: list[Exit], executing: set[tuple[str, int]] = frozenset()) -> None:
        self.pending = exits
        self.executing = set(executing)
        self.forgotten: list[tuple[str, int]] = []
        self.stopped: list[set[tuple[str, int]]] = []

    async def start(self) -> None: ...

    def running(self) -> set[tuple[str, int]]:
        return set(self.executing)

    async def forget(self, rollout_id: str, attempt: int) -> None:
        self.forgotten.append((rollout_id, attempt))

    async def stop(self, keys: set[tuple[str, int]]) -> None:
        # A stopped execution is gone, as with the real executors; left "executing", later
        # reconcile passes would stop it again and again.
        self.stopped.append(set(keys))
        self.executing -= keys

    async def launch(self, launch: Launch) -> None:
        raise AssertionError("nothing to launch")

    async def exits(self) -> list[Exit]:
        out, self.pending = self.pending, []
        return out

    async def close(self) -> None: ...


def test_gateway_errors_are_retried_on_the_next_pass(
    gateway: GatewayProcess, admin: GatewayClient
) -> None:
    """An unreachable gateway fails no pass and loses no exit; a 404 drops the exit."""
    rid = f"r-{uuid.uuid4().hex[:12]}"
    admin.create_rollouts([{"rollout_id": rid, "group_id": "g"}])
    admin.patch_rollout(rid, "running", attempt=1)
    dead_url = f"http://127.0.0.1:{free_port()}"

    async def main() -> None:
        # No free slot: the module's gateway may hold other tests' rollouts.
        ex = ScriptedExecutor([Exit(rid, 1, None), Exit("no-such-rollout", 1, None)])
        async with httpx.AsyncClient() as http:
            down = AsyncGatewayClient(dead_url, gateway.token, retries=0, http=http)
            controller = Controller(down, ex, gateway_url=dead_url, model="m")
            await controller.step()
            await controller.step()
            assert len(controller._unsettled) == 2
            controller.client = AsyncGatewayClient(gateway.url, gateway.token, http=http)
            await controller.step()
            assert controller._unsettled == []
            assert (controller.stats.exited_without_status, controller.stats.given_up) == (1, 1)

    asyncio.run(main())
    rollout = admin.get_rollout(rid)
    assert (rollout.status, rollout.error) == (Status.FAILED, NO_STATUS)


@pytest.mark.parametrize("kind", ["python", "command"])
def test_local_stop_ends_an_attempt_with_orphaned(kind: str, tmp_path: Path) -> None:
    harness = f"{HARNESSES}:hangs" if kind == "python" else "command:exec sleep 60"

    async def main() -> None:
        ex = executor(tmp_path, harness)
        await ex.start()
        try:
            env = {"AGL_ROLLOUT_ID": "r", "AGL_ATTEMPT": "1"}
            await ex.launch(Launch("r", 1, None, env))
            await wait_until(lambda: ex.running() == {("r", 1)})
            await asyncio.sleep(0.2)
            await ex.stop({("r", 1)})
            exits: list[Exit] = []

            async def ended() -> bool:
                exits.extend(await ex.exits())
                return bool(exits)

            await wait_until(ended, 10)
            assert exits == [Exit("r", 1, ORPHANED)]
            assert ex.running() == set()
        finally:
            await ex.close()

    asyncio.run(main())


def test_reconcile_fails_lost_attempts_and_stops_orphans(tmp_path: Path) -> None:
    """A running attempt nothing executes is failed (LOST); an execution whose rollout
    moved on is stopped once two passes in a row saw it so; what runs is left alone."""
    with gateway_process(tmp_path / "gw") as gw, GatewayClient(gw.url, gw.token) as admin:
        ids = ("lost", "mine", "done")
        admin.create_rollouts([{"rollout_id": r, "group_id": "g", "max_attempts": 1} for r in ids])
        for rid in ids:
            admin.patch_rollout(rid, "running", attempt=1)
        admin.patch_rollout("done", "succeeded", attempt=1)
        ex = ScriptedExecutor([], executing={("mine", 1), ("done", 1)})

        async def main() -> None:
            async with httpx.AsyncClient() as http:
                client = AsyncGatewayClient(gw.url, gw.token, http=http)
                controller = Controller(
                    client, ex, gateway_url=gw.url, model="m", poll_s=0.01, reconcile_s=0
                )
                task = asyncio.create_task(controller.run())
                try:
                    await wait_until(lambda: controller.stats.orphans_stopped == 1, 30)
                except TimeoutError:
                    raise AssertionError(f"{controller.stats}, {ex.stopped}") from None
                assert (controller.stats.lost, controller.stats.given_up) == (1, 1)
                assert admin.get_rollout("mine").status is Status.RUNNING
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

        asyncio.run(main())
        lost = admin.get_rollout("lost")
        assert (lost.status, lost.error) == (Status.FAILED, LOST)
        assert ex.stopped == [{("done", 1)}]
        assert ("lost", 1) in ex.forgotten


# -- throughput (printed, not asserted) -------------------------------------------------


def test_throughput_trivial_harness(
    gateway: GatewayProcess, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    group = new_group()
    n = 400

    async def main() -> float:
        ex = executor(tmp_path, f"{HARNESSES}:finish_only", workers=2)
        async with running(gateway, ex) as (controller, client):
            started = time.perf_counter()
            await client.create_rollouts(specs(group, [{}] * n))
            # Watch the controller, not the gateway: polling the list would cost the
            # gateway more CPU than what is measured.
            await wait_until(lambda: controller.stats.exited_ok == n, 180)
            elapsed = time.perf_counter() - started
            rollouts = await client.list_rollouts(group_id=group)
            assert all(r.status is Status.SUCCEEDED for r in rollouts)
        return elapsed

    elapsed = asyncio.run(main())
    with capsys.disabled():
        print(
            f"\ncontroller throughput: {n / elapsed:.0f} rollouts/s ({n} in {elapsed:.2f} s, "
            "trivial python harness, 2 workers, gateway on loopback)"
        )


ORPHAN_SCRIPT = """\
import asyncio, sys
from pathlib import Path
from agl.backends.execution.local.config import LocalExecutorConfig
from agl.backends.execution.local.executor import LocalExecutor

async def main() -> None:
    config = LocalExecutorConfig(
        harness="tests.helpers.controller_harnesses:by_input", run_dir=Path(sys.argv[1]), workers=2
    )
    ex = LocalExecutor(config)
    await ex.start()
    print(*ex.pids(), flush=True)
    await asyncio.sleep(60)

asyncio.run(main())
"""


def test_workers_die_with_a_killed_parent(tmp_path: Path) -> None:
    """``kill -9`` of the controller's process runs no cleanup: the kernel must do it."""
    with subprocess.Popen(
        [sys.executable, "-c", ORPHAN_SCRIPT, str(tmp_path / "run")],
        stdout=subprocess.PIPE,
        cwd=REPO,
        text=True,
    ) as parent:
        try:
            assert parent.stdout is not None
            workers = [int(pid) for pid in parent.stdout.readline().split()]
            assert len(workers) == 2 and all(map(alive, workers))
        finally:
            parent.kill()
    deadline = time.monotonic() + 30
    while any(map(alive, workers)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(map(alive, workers))


@pytest.mark.slow
def test_a_controller_killed_mid_batch_loses_nothing_and_launches_nothing_twice(
    tmp_path: Path,
) -> None:
    """``python -m agl.controller executor=local`` is killed (-9) with attempts running:
    its workers die with it; the next controller fails those attempts as lost and runs
    them again as new attempts. Every rollout ends succeeded; no attempt ran twice."""
    ids = [f"k{i}" for i in range(16)]
    go = tmp_path / "go"  # no attempt finishes before it exists: the first batch is killed
    with gateway_process(tmp_path / "gw") as gw, GatewayClient(gw.url, gw.token) as admin:
        held = {"reward": 1, "until": str(go)}
        admin.create_rollouts([{"rollout_id": r, "input": held, "max_attempts": 3} for r in ids])
        command = [
            sys.executable,
            "-m",
            "agl.controller",
            "executor=local",
            f"harness={HARNESSES}:reward_from_input",
            f"gateway_url={gw.url}",
            "model=policy",
            "reconcile_s=0.5",
            "workers=2",
            "concurrency=4",  # attempts per worker: 8 at once
            f"run_dir={tmp_path / 'controller'}",
            "log_level=warning",
        ]
        env = {**os.environ, "AGL_ADMIN_TOKEN": gw.token}

        def statuses() -> list[Status]:
            return [admin.get_rollout(r).status for r in ids]

        def started() -> int:
            """Attempts whose agent has begun (posted its ``seen``)."""
            return sum(bool(admin.get_events(r, type="seen")) for r in ids)

        first = subprocess.Popen(command, cwd=REPO, env=env)
        try:
            deadline = time.monotonic() + 120
            while started() < 8:  # all it may run at once, and none can finish
                assert first.poll() is None and time.monotonic() < deadline
                time.sleep(0.05)
            workers = psutil.Process(first.pid).children(recursive=True)
            first.kill()
            first.wait(10)
            psutil.wait_procs(workers, timeout=10)
            assert not [w for w in workers if w.is_running()], "workers outlived it"
        finally:
            first.kill()
        go.touch()
        second = subprocess.Popen(command, cwd=REPO, env=env)
        try:
            deadline = time.monotonic() + 150
            while any(s is not Status.SUCCEEDED for s in statuses()):
                assert second.poll() is None and time.monotonic() < deadline, statuses()
                time.sleep(0.1)
        finally:
            second.terminate()
            second.wait(30)
        attempts = []
        for rid in ids:
            rollout = admin.get_rollout(rid)
            seen = admin.get_events(rid, type="seen")
            # One launch per attempt: the one killed with the first controller, if any,
            # then the one that succeeded.
            assert sorted(e.attempt for e in seen) == list(range(1, rollout.attempt + 1))
            attempts.append(rollout.attempt)
        assert sorted(attempts) == [1] * 8 + [2] * 8  # the 8 killed were each run again
