"""agl.testing.k8s against the real server: ApiServer (start, restart, compaction) and
NodeSimulator (runs Jobs' containers as processes, writes Job status as the controller)."""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client as k8s
from kubernetes import watch as k8s_watch
from kubernetes.client import ApiClient, V1Job

from agl.testing.k8s.api_server import ApiServer, serves
from agl.testing.k8s.job_status import BACKOFF_LIMIT_EXCEEDED, DEADLINE_EXCEEDED
from agl.testing.k8s.node import NodeSimulator

UNAVAILABLE = ApiServer.available()
pytestmark = pytest.mark.skipif(UNAVAILABLE is not None, reason=str(UNAVAILABLE))

MANAGED = {"app.kubernetes.io/managed-by": "agl"}


def wait_for(predicate: Callable[[], Any], timeout_s: float = 10.0, what: str = "") -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout_s} s: {what or predicate}")


def job_manifest(
    name: str, script: str, env: list[dict[str, Any]] | None = None, **spec: Any
) -> dict[str, Any]:
    container = {"name": "main", "image": "none", "command": ["sh", "-c", script]}
    if env:
        container["env"] = env
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "labels": MANAGED},
        "spec": {
            "backoffLimit": 0,
            "template": {"spec": {"restartPolicy": "Never", "containers": [container]}},
            **spec,
        },
    }


def terminal(job: V1Job) -> tuple[str, str | None] | None:
    """(type, reason) of the Job's Complete/Failed condition, None while it runs."""
    for c in (job.status.conditions if job.status else None) or []:
        if c.type in ("Complete", "Failed") and c.status == "True":
            return c.type, c.reason
    return None


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiServer]:
    with ApiServer(tmp_path_factory.mktemp("k8s")) as api_server:
        yield api_server


@pytest.fixture
def api(server: ApiServer) -> Iterator[ApiClient]:
    with server.api_client() as api_client:
        yield api_client


@pytest.fixture
def namespace(api: ApiClient) -> str:
    """A namespace per test, so one test's simulator never sees another's Jobs."""
    name = f"t-{uuid.uuid4().hex[:8]}"
    k8s.CoreV1Api(api).create_namespace({"metadata": {"name": name}})
    return name


@pytest.fixture
def secrets_served(api: ApiClient) -> None:
    if not serves(api, "secrets"):
        pytest.skip("this miniapiserver does not serve core/v1 secrets (an older binary)")


def watch_error(batch: k8s.BatchV1Api, resource_version: str) -> int | None:
    """The error code a Job watch from ``resource_version`` ends with. The server sends an
    expired version's 410 as an ERROR event in a 200 response; the client raises it."""
    try:
        for event in k8s_watch.Watch().stream(
            batch.list_namespaced_job,
            "default",
            resource_version=resource_version,
            timeout_seconds=5,
        ):
            if event["type"] == "ERROR":
                return int(event["raw_object"]["code"])
    except k8s.ApiException as e:
        return e.status
    return None


class Cluster:
    """A namespace's Jobs, for the tests' side of the API."""

    def __init__(self, api: ApiClient, namespace: str) -> None:
        self.batch = k8s.BatchV1Api(api)
        self.core = k8s.CoreV1Api(api)
        self.namespace = namespace

    def create(self, manifest: dict[str, Any]) -> V1Job:
        return self.batch.create_namespaced_job(self.namespace, manifest)

    def get(self, name: str) -> V1Job:
        return self.batch.read_namespaced_job(name, self.namespace)

    def wait_terminal(self, name: str, timeout_s: float = 10.0) -> tuple[str, str | None]:
        return wait_for(lambda: terminal(self.get(name)), timeout_s, f"Job {name} terminal")


@pytest.fixture
def cluster(api: ApiClient, namespace: str) -> Cluster:
    return Cluster(api, namespace)


@pytest.fixture
def node(
    server: ApiServer, namespace: str, tmp_path: Path
) -> Iterator[Callable[..., NodeSimulator]]:
    """Start a NodeSimulator on the test's namespace; all are stopped at the end."""
    made: list[NodeSimulator] = []

    def make(**options: Any) -> NodeSimulator:
        options.setdefault("log_dir", tmp_path / "logs")
        simulator = NodeSimulator(server.api_client, namespace, **options).start()
        made.append(simulator)
        return simulator

    yield make
    for simulator in made:
        simulator.stop()


# ---- the server


def test_server_answers_and_stores_jobs(server: ApiServer, cluster: Cluster) -> None:
    assert server.kubeconfig.is_file() and server.url.endswith(str(server.port))
    assert serves(cluster.batch.api_client, "jobs", "batch/v1")
    assert not serves(cluster.batch.api_client, "jobs", "batch/v9")
    created = cluster.create(job_manifest("stored", "true"))
    assert created.status.active is None  # no controller: nobody touches it
    listed = cluster.batch.list_namespaced_job(
        cluster.namespace, label_selector="app.kubernetes.io/managed-by=agl"
    )
    assert [j.metadata.name for j in listed.items] == ["stored"]
    cluster.batch.delete_namespaced_job("stored", cluster.namespace)
    assert cluster.batch.list_namespaced_job(cluster.namespace).items == []


def test_a_server_that_cannot_start_says_why(tmp_path: Path) -> None:
    broken = ApiServer(tmp_path / "broken", extra_args=["--no-such-flag"])
    with pytest.raises(RuntimeError, match="no-such-flag"):
        broken.start()
    broken.stop()  # already stopped, etcd included: a no-op


def test_secret_round_trip(cluster: Cluster, secrets_served: None) -> None:
    cluster.core.create_namespaced_secret(
        cluster.namespace,
        {"metadata": {"name": "key", "labels": MANAGED}, "data": {"api-key": "czNjcjN0"}},
    )
    secret = cluster.core.read_namespaced_secret("key", cluster.namespace)
    assert secret.data == {"api-key": "czNjcjN0"}
    cluster.core.delete_namespaced_secret("key", cluster.namespace)


# ---- the node


def test_job_completes_with_its_env(
    cluster: Cluster, node: Callable[..., NodeSimulator], tmp_path: Path
) -> None:
    simulator = node()
    env = [{"name": "FOO", "value": "from-the-spec"}]
    cluster.create(job_manifest("ok", "echo FOO=$FOO; exit 0", env))
    assert cluster.wait_terminal("ok") == ("Complete", "CompletionsReached")
    job = cluster.get("ok")
    assert (job.status.succeeded, job.status.active) == (1, None)  # 0 is omitted
    assert job.status.start_time is not None and job.status.completion_time is not None
    assert [c.type for c in job.status.conditions] == ["SuccessCriteriaMet", "Complete"]
    assert job.spec.template.spec.containers[0].env[0].value == "from-the-spec"  # spec kept
    assert "FOO=from-the-spec" in (tmp_path / "logs" / "ok.log").read_text()
    assert simulator.started == ["ok"] and simulator.running() == set()


def test_nonzero_exit_fails_the_job(cluster: Cluster, node: Callable[..., NodeSimulator]) -> None:
    node()
    cluster.create(job_manifest("bad", "exit 3"))
    assert cluster.wait_terminal("bad") == ("Failed", BACKOFF_LIMIT_EXCEEDED.reason)
    job = cluster.get("bad")
    assert job.status.failed == 1 and job.status.completion_time is None
    assert [c.type for c in job.status.conditions] == ["FailureTarget", "Failed"]
    assert job.status.conditions[1].message == BACKOFF_LIMIT_EXCEEDED.message


def _staged(name: str, first: str, then: str) -> dict[str, Any]:
    """A Job whose init container runs ``first`` and then its container ``then``, both
    with an emptyDir at /shared (as $SHARED) and ``then`` working in it."""
    job = job_manifest(name, then, [{"name": "SHARED", "value": "/shared"}])
    pod = job["spec"]["template"]["spec"]
    mount = {"name": "shared", "mountPath": "/shared"}
    pod["containers"][0].update(volumeMounts=[mount], workingDir="/shared")
    pod["initContainers"] = [
        {
            "name": "first",
            "image": "none",
            "command": ["sh", "-c", first],
            "env": [{"name": "SHARED", "value": "/shared/"}],
            "volumeMounts": [mount],
        }
    ]
    pod["volumes"] = [{"name": "shared", "emptyDir": {}}]
    return job


def test_init_containers_run_first_and_share_an_empty_dir(
    cluster: Cluster, node: Callable[..., NodeSimulator], tmp_path: Path
) -> None:
    simulator = node()
    cluster.create(_staged("staged", "echo left > ${SHARED}note", "echo read=$(cat note)"))
    assert cluster.wait_terminal("staged") == ("Complete", "CompletionsReached")
    assert "read=left" in (tmp_path / "logs" / "staged.log").read_text()
    assert simulator.started == ["staged"]  # one pod, started once
    assert not (tmp_path / "logs" / "staged.volumes").exists()  # gone with the pod


def test_a_failed_init_container_fails_the_pod_and_nothing_runs_after_it(
    cluster: Cluster, node: Callable[..., NodeSimulator], tmp_path: Path
) -> None:
    node()
    cluster.create(_staged("halted", "exit 4", "echo ran-after"))
    assert cluster.wait_terminal("halted") == ("Failed", BACKOFF_LIMIT_EXCEEDED.reason)
    assert "ran-after" not in (tmp_path / "logs" / "halted.log").read_text()


def test_a_job_has_a_pod_on_the_node_whose_logs_the_api_server_serves(
    cluster: Cluster, node: Callable[..., NodeSimulator], api: ApiClient, namespace: str
) -> None:
    """The pod the Job controller would make, bound to the simulator's Node: each
    container's exit in its status before the Job ends, each container's own output
    through the API server's ``pods/log`` (proxied to the node's kubelet), and the pod gone
    with its Job."""
    simulator = node()
    cluster.create(_staged("logged", "echo one; echo two", "echo three; exit 5"))
    assert cluster.wait_terminal("logged") == ("Failed", BACKOFF_LIMIT_EXCEEDED.reason)
    core = k8s.CoreV1Api(api)
    (pod,) = core.list_namespaced_pod(namespace, label_selector="job-name=logged").items
    assert pod.spec.node_name == simulator.node_name
    assert pod.metadata.owner_references[0].name == "logged"
    assert pod.metadata.name.startswith("logged-")
    assert pod.status.phase == "Failed"
    (first,) = pod.status.init_container_statuses
    (main,) = pod.status.container_statuses
    assert (first.state.terminated.exit_code, first.state.terminated.reason) == (0, "Completed")
    assert (main.state.terminated.exit_code, main.state.terminated.reason) == (5, "Error")
    name = pod.metadata.name

    def log(**options: Any) -> str:
        # Raw: the client's own decoding of text/plain answers gives "b'...'".
        answer = core.read_namespaced_pod_log(name, namespace, _preload_content=False, **options)
        return answer.data.decode()

    assert log(container="first") == "one\ntwo\n"
    assert log(container="first", tail_lines=1) == "two\n"
    assert log(limit_bytes=3) == "thr"  # the one container, by default
    with pytest.raises(k8s.ApiException) as missing:
        log(container="nope")
    assert missing.value.status == 404
    k8s.BatchV1Api(api).delete_namespaced_job("logged", namespace, propagation_policy="Background")
    wait_for(
        lambda: not core.list_namespaced_pod(namespace, label_selector="job-name=logged").items,
        what="the pod deleted with its Job",
    )


def test_secret_key_ref_waits_for_the_secret(
    cluster: Cluster, node: Callable[..., NodeSimulator], tmp_path: Path, secrets_served: None
) -> None:
    simulator = node()
    ref = {"secretKeyRef": {"name": "attempt-key", "key": "api-key"}}
    cluster.create(job_manifest("keyed", "echo KEY=$KEY", [{"name": "KEY", "valueFrom": ref}]))
    wait_for(lambda: cluster.get("keyed").status.active == 1, what="active: 1")
    time.sleep(0.5)  # the kubelet retries while the Secret is missing; the Job stays active
    assert simulator.started == [] and terminal(cluster.get("keyed")) is None
    cluster.core.create_namespaced_secret(
        cluster.namespace, {"metadata": {"name": "attempt-key"}, "data": {"api-key": "czNjcjN0"}}
    )
    assert cluster.wait_terminal("keyed") == ("Complete", "CompletionsReached")
    assert "KEY=s3cr3t" in (tmp_path / "logs" / "keyed.log").read_text()


def test_deadline_fails_a_job_started_or_not(
    cluster: Cluster, node: Callable[..., NodeSimulator], tmp_path: Path
) -> None:
    simulator = node(start=lambda job: job.metadata.name != "stuck")
    pid_file = tmp_path / "pid"
    cluster.create(job_manifest("stuck", "exit 0", activeDeadlineSeconds=1))
    cluster.create(
        job_manifest("slow", f"echo $$ > {pid_file}; exec sleep 60", activeDeadlineSeconds=1)
    )
    assert wait_for(lambda: cluster.get("stuck").status.active == 1, what="active: 1")
    for name in ("stuck", "slow"):
        assert cluster.wait_terminal(name, timeout_s=5) == ("Failed", DEADLINE_EXCEEDED.reason)
        assert cluster.get(name).status.conditions[1].message == DEADLINE_EXCEEDED.message
    assert simulator.started == ["slow"] and simulator.running() == set()
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid_file.read_text()), 0)  # killed and reaped


def test_deleting_a_running_job_kills_its_process(
    cluster: Cluster, node: Callable[..., NodeSimulator], tmp_path: Path
) -> None:
    simulator = node()
    pid_file = tmp_path / "pid"
    cluster.create(job_manifest("long", f"echo $$ > {pid_file}; exec sleep 60"))
    wait_for(lambda: "long" in simulator.running() and pid_file.is_file(), what="running")
    pid = int(wait_for(lambda: pid_file.read_text().strip(), what="pid written"))
    cluster.batch.delete_namespaced_job("long", cluster.namespace)
    wait_for(lambda: not simulator.running(), what="pod forgotten")
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # killed and reaped


def test_outcome_mode_runs_no_process(cluster: Cluster, node: Callable[..., NodeSimulator]) -> None:
    simulator = node(log_dir=None, outcome=lambda job: (0.2, job.metadata.name != "lose"))
    for name in ("win", "lose"):
        cluster.create(job_manifest(name, "exit 99"))
    assert cluster.wait_terminal("win") == ("Complete", "CompletionsReached")
    assert cluster.wait_terminal("lose") == ("Failed", BACKOFF_LIMIT_EXCEEDED.reason)
    assert sorted(simulator.started) == ["lose", "win"]


def test_terminal_jobs_are_never_rerun(
    cluster: Cluster, node: Callable[..., NodeSimulator]
) -> None:
    first = node()
    cluster.create(job_manifest("once", "exit 0"))
    cluster.wait_terminal("once")
    first.stop()
    second = node()
    cluster.create(job_manifest("after", "exit 0"))
    cluster.wait_terminal("after")
    assert first.started == ["once"] and second.started == ["after"]


def test_simulator_survives_an_apiserver_restart(
    server: ApiServer, cluster: Cluster, node: Callable[..., NodeSimulator]
) -> None:
    simulator = node()
    cluster.create(job_manifest("before", "exit 0"))
    cluster.wait_terminal("before")
    # From a thread that then ends: the server must outlive it (no parent-death signal).
    restarter = threading.Thread(target=server.restart_apiserver)
    restarter.start()
    restarter.join()
    time.sleep(0.2)
    cluster.create(job_manifest("after-restart", "exit 0"))  # the old client works on
    assert cluster.wait_terminal("after-restart") == ("Complete", "CompletionsReached")
    assert simulator.started == ["before", "after-restart"]


def test_compaction_gives_410_and_the_simulator_relists(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Without the watch cache, watches come from etcd: a compacted resourceVersion is 410
    Gone. The simulator's watch, resumed after a restart from a version compacted away
    meanwhile, relists and goes on."""
    caplog.set_level(logging.INFO, logger="agl.testing.k8s")
    flags = ["--watch-cache=false", "--etcd-compaction-interval=0"]
    with ApiServer(tmp_path / "server", extra_args=flags) as server, server.api_client() as api:
        cluster = Cluster(api, "default")
        with NodeSimulator(server.api_client, log_dir=tmp_path / "logs") as simulator:
            cluster.create(job_manifest("early", "exit 0"))
            cluster.wait_terminal("early")
            old = cluster.batch.list_namespaced_job("default").metadata.resource_version
            for i in range(3):  # writes the simulator's watch does not see
                cluster.core.create_namespace({"metadata": {"name": f"filler-{i}"}})
            assert server.compact() > int(old)
            assert watch_error(cluster.batch, old) == 410
            server.restart_apiserver()
            cluster.create(job_manifest("late", "exit 0"))
            assert cluster.wait_terminal("late") == ("Complete", "CompletionsReached")
            assert simulator.started == ["early", "late"]
    assert any("410 Gone; relisting" in r.getMessage() for r in caplog.records)
