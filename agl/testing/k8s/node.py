"""``NodeSimulator``: the Job controller, the scheduler and the kubelet for an API server
that has none of them. It runs a Job's container command as a local process (or decides an
outcome) and writes the Job's status as the real controller would; in process mode it also
keeps the Job's Pod, on a Node of its own whose kubelet serves the containers' logs."""

from __future__ import annotations

import base64
import heapq
import itertools
import json
import logging
import os
import queue
import secrets
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace, TracebackType

from kubernetes import client as k8s
from kubernetes.client import ApiClient, ApiException, V1Job

from agl.testing.k8s.job_status import (
    BACKOFF_LIMIT_EXCEEDED,
    DEADLINE_EXCEEDED,
    Failure,
    Manifest,
    final_status,
    is_terminal,
    job_name,
    job_uid,
    rfc3339,
)
from agl.testing.k8s.kubelet import LogServer
from agl.testing.k8s.node_api import MERGE_PATCH, TRANSIENT, JobEvent, JobWatcher, StatusWriter
from agl.testing.k8s.process_groups import kill_group, spawn

# Named for the package: the name log lines and tests' log captures know it by.
log = logging.getLogger("agl.testing.k8s")

MANAGED_BY_AGL = "app.kubernetes.io/managed-by=agl"


@dataclass(order=True)
class _Timer:
    when: float  # time.monotonic()
    seq: int
    kind: str = field(compare=False)  # "deadline" | "outcome" | "launch"
    uid: str = field(compare=False)
    succeeds: bool = field(default=False, compare=False)


@dataclass
class _Pod:
    """An admitted Job that has not finished: its pod, held, waiting for a Secret, or
    running (``process`` in process mode, an outcome timer otherwise)."""

    job: Manifest
    process: subprocess.Popen[bytes] | None = None
    stage: int = 0  # which of ``containers(job)`` runs or runs next
    pod_name: str | None = None  # its Pod object (process mode), once created
    started_at: str | None = None
    statuses: dict[str, Manifest] = field(default_factory=dict)  # container -> its status

    @property
    def uid(self) -> str:
        return job_uid(self.job)

    @property
    def name(self) -> str:
        return job_name(self.job)

    @property
    def containers(self) -> list[Manifest]:
        """What runs, in order: the init containers, then the first container."""
        spec = self.job["spec"]["template"]["spec"]
        return [*(spec.get("initContainers") or []), spec["containers"][0]]


@dataclass
class _PodLogs:
    """Where a pod's containers wrote: one file, each container a span of it."""

    path: Path
    spans: dict[str, tuple[int, int | None]] = field(default_factory=dict)  # end None: running


class NodeSimulator:
    """The Job controller and the kubelet, for an API server that has neither.

    Each new Job (matching ``label_selector`` in ``namespace``) gets ``startTime`` and
    ``active: 1`` at once; then, unless ``start(job)`` says no (a node that never starts
    it), its pod runs: each init container, then the first container, one after the other
    while each exits 0, its ``command + args`` as a local process with the test's
    environment (less ``AGL_ADMIN_TOKEN``) plus the container's ``env`` (literal values and
    ``secretKeyRef`` read from the API server, retried every 0.2 s while missing, as the
    kubelet does), in ``workingDir``, output to ``log_dir/<job>.log``. In this mode each
    Job gets a Pod object as the Job controller makes one (``<job>-<5 chars>``, labelled
    ``job-name``, owned by the Job), bound to the simulator's Node (``node_name``, with
    the kubelet's log endpoint, ``agl.testing.k8s.kubelet``, at its InternalIP and port),
    with its phase and each container's ``terminated`` state (exit code, reason) written
    before the Job's final status; deleting the Job deletes it, as the garbage collector
    would. A pod killed at the deadline keeps its Pod (a real Job controller deletes it).
    An ``emptyDir``
    volume is a folder of the pod's (``log_dir/<job>.volumes/<name>``, removed with the
    pod); with no mount namespaces here, a container's ``mountPath`` of one is rewritten
    to that folder in its ``workingDir`` and ``env`` values (``readOnly`` is not
    enforced), and no other volume kind is mounted. With
    ``outcome`` no process runs: after ``outcome(job)[0]`` seconds the Job succeeds or fails
    as ``outcome(job)[1]`` says. Exit 0 completes the Job; anything else fails it at once
    (as with ``backoffLimit: 0``); ``activeDeadlineSeconds``, counted from ``startTime``,
    kills the pod and fails the Job.

    Invariants: a Job (by uid) is started at most once per simulator; a Job already
    Complete or Failed when first seen is left alone (so a relist or a new simulator reruns
    nothing); a deleted Job's process group is killed; the simulator is the only writer of
    Job status conditions. ``api_client_factory`` must return a new client per call: the
    simulator closes those it made.
    """

    SECRET_RETRY_S = 0.2
    POLL_S = 0.05  # how often running processes are checked for exit
    IDLE_S = 0.5

    def __init__(
        self,
        api_client_factory: Callable[[], ApiClient],
        namespace: str = "default",
        label_selector: str = MANAGED_BY_AGL,
        *,
        log_dir: Path | None = None,
        start: Callable[[V1Job], bool] | None = None,
        outcome: Callable[[V1Job], tuple[float, bool]] | None = None,
    ) -> None:
        if outcome is None and log_dir is None:
            raise ValueError("log_dir is needed to run the Jobs' processes")
        self._factory = api_client_factory
        self._namespace = namespace
        self._log_dir = log_dir
        self._start = start
        self._outcome = outcome
        self._events: queue.SimpleQueue[JobEvent] = queue.SimpleQueue()
        self._watcher = JobWatcher(api_client_factory, namespace, label_selector, self._events.put)
        self._writer = StatusWriter(api_client_factory, namespace)
        self._stopping = threading.Event()
        # Daemon threads: a simulator left unstopped must not hang the interpreter's exit.
        self._thread = threading.Thread(target=self._run, name="k8s-node", daemon=True)
        # Owned by the node thread:
        self._core: k8s.CoreV1Api  # made in the node thread, from a client it owns
        self._pods: dict[str, _Pod] = {}
        self._seen: set[str] = set()  # uids ever admitted or found terminal
        self._timers: list[_Timer] = []
        self._seq = itertools.count()
        self._pod_names: dict[str, str] = {}  # Job uid -> its Pod, until the Job is deleted
        # Shared with readers (the kubelet's threads too), under _lock:
        self._lock = threading.Lock()
        self._started: list[str] = []
        self._running: dict[str, str] = {}  # uid -> job name
        self._logs: dict[str, _PodLogs] = {}  # Pod name -> where its containers wrote
        self.node_name = f"agl-node-{secrets.token_hex(4)}"
        self._kubelet = LogServer(self._container_log) if outcome is None else None

    # -- lifecycle

    def start(self) -> NodeSimulator:
        if self._log_dir is not None:
            self._log_dir.mkdir(parents=True, exist_ok=True)
        if self._kubelet is not None:
            self._kubelet.start()
        self._writer.start()
        self._thread.start()
        self._watcher.start()
        return self

    def stop(self) -> None:
        """Stop watching, kill every pod's process group, write the status patches already
        queued; a no-op once stopped."""
        if self._stopping.is_set():
            return
        self._watcher.stop()
        self._stopping.set()
        self._events.put(("wake", None))  # rather than waiting out the node's idle poll
        self._thread.join()
        self._writer.close()
        if self._kubelet is not None:
            self._kubelet.stop()

    def __enter__(self) -> NodeSimulator:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- introspection (any thread)

    @property
    def started(self) -> list[str]:
        """Job names in the order their pods started (a name recurs if a Job is recreated)."""
        with self._lock:
            return list(self._started)

    @property
    def finished(self) -> dict[str, float]:
        """Job name -> wall-clock time (``time.time()``) its terminal status was written."""
        return dict(self._writer.finished)

    def count_started(self, name: str) -> int:
        return self.started.count(name)

    def running(self) -> set[str]:
        """Names of the Jobs whose pod started and has not finished."""
        with self._lock:
            return set(self._running.values())

    # -- the node thread

    def _run(self) -> None:
        with self._factory() as api_client:
            self._core = k8s.CoreV1Api(api_client)
            self._register_node()
            try:
                while not self._stopping.is_set():
                    try:
                        self._take_events(self._wait_s())
                        self._fire_timers()
                        self._reap()
                    except Exception:
                        # One malformed Job must not stop the node for all the others.
                        log.exception("node: step failed")
            finally:
                for pod in list(self._pods.values()):
                    self._drop(pod)

    def _wait_s(self) -> float:
        wait = self.POLL_S if self._any_process() else self.IDLE_S
        if self._timers:
            wait = min(wait, self._timers[0].when - time.monotonic())
        return max(wait, 0.0)

    def _take_events(self, wait_s: float) -> None:
        try:
            event = self._events.get(timeout=wait_s)
        except queue.Empty:
            return
        while True:
            self._handle(event)
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                return

    def _handle(self, event: JobEvent) -> None:
        kind, payload = event
        if kind == "sync":
            self._sync(payload)
        elif kind == "DELETED":
            self._deleted(job_uid(payload))
        elif kind in ("ADDED", "MODIFIED"):
            self._observe(payload)

    def _sync(self, jobs: list[Manifest]) -> None:
        """After a relist: a Job no longer listed was deleted while the watch was down."""
        listed = {job_uid(job) for job in jobs}
        for uid in [uid for uid in {*self._pods, *self._pod_names} if uid not in listed]:
            self._deleted(uid)
        for job in jobs:
            self._observe(job)

    def _observe(self, job: Manifest) -> None:
        uid = job_uid(job)
        if (pod := self._pods.get(uid)) is not None:
            pod.job = job
            return
        if uid in self._seen:
            return
        self._seen.add(uid)
        if not is_terminal(job):
            self._admit(job)

    def _deleted(self, uid: str) -> None:
        if (pod := self._pods.get(uid)) is not None:
            log.info("node: Job %s deleted; killing its pod", pod.name)
            self._drop(pod)
        if (pod_name := self._pod_names.pop(uid, None)) is not None:
            self._delete_pod(pod_name)

    def _admit(self, job: Manifest) -> None:
        now = datetime.now(UTC)
        recorded = (job.get("status") or {}).get("startTime")
        start_time = datetime.fromisoformat(recorded) if recorded else now
        if not recorded:
            self._writer.patch(job, {"startTime": rfc3339(now), "active": 1})
        pod = _Pod(job)
        self._pods[pod.uid] = pod
        if self._outcome is None:
            self._create_pod(pod)
        if (deadline_s := job["spec"].get("activeDeadlineSeconds")) is not None:
            self._at(deadline_s - (now - start_time).total_seconds(), "deadline", pod.uid)
        model = None
        if self._start is not None:
            model = self._model(job)
            if not self._start(model):
                log.info("node: Job %s admitted, its pod never starts", pod.name)
                return
        if self._outcome is not None:
            delay_s, succeeds = self._outcome(model or self._model(job))
            self._mark_started(pod)
            self._at(delay_s, "outcome", pod.uid, succeeds)
        else:
            self._launch(pod)

    def _model(self, job: Manifest) -> V1Job:
        # The client deserializes a response: anything with the JSON text as ``data``.
        body = SimpleNamespace(data=json.dumps(job))
        return self._core.api_client.deserialize(body, "V1Job")

    def _at(self, delay_s: float, kind: str, uid: str, succeeds: bool = False) -> None:
        when = time.monotonic() + delay_s
        heapq.heappush(self._timers, _Timer(when, next(self._seq), kind, uid, succeeds))

    def _fire_timers(self) -> None:
        now = time.monotonic()
        while self._timers and self._timers[0].when <= now:
            timer = heapq.heappop(self._timers)
            pod = self._pods.get(timer.uid)
            if pod is None:
                continue  # finished or deleted since
            if timer.kind == "deadline":
                log.info("node: Job %s passed its activeDeadlineSeconds", pod.name)
                self._finish(pod, DEADLINE_EXCEEDED)
            elif timer.kind == "outcome":
                self._finish(pod, None if timer.succeeds else BACKOFF_LIMIT_EXCEEDED)
            elif pod.process is None:
                self._launch(pod)

    def _any_process(self) -> bool:
        return self._outcome is None and any(p.process for p in self._pods.values())

    def _reap(self) -> None:
        if self._outcome is not None:
            return  # no processes: outcomes come from timers
        for pod in list(self._pods.values()):
            if pod.process is not None and (code := pod.process.poll()) is not None:
                log.info("node: Job %s's process exited with %d", pod.name, code)
                self._container_ended(pod, code, "Completed" if code == 0 else "Error")
                if code == 0 and pod.stage + 1 < len(pod.containers):
                    kill_group(pod.process)  # a container's leftovers end with it
                    pod.process, pod.stage = None, pod.stage + 1
                    self._launch(pod)
                else:
                    self._finish(pod, None if code == 0 else BACKOFF_LIMIT_EXCEEDED)

    def _launch(self, pod: _Pod) -> None:
        assert self._log_dir is not None
        container = pod.containers[pod.stage]
        mounts = self._mounts(pod, container)
        env = self._environment(container, mounts)
        if env is None:
            self._at(self.SECRET_RETRY_S, "launch", pod.uid)
            return
        log_path = self._log_dir / f"{pod.name}.log"
        argv = [*(container.get("command") or []), *(container.get("args") or [])]
        self._container_started(pod, log_path)
        try:
            if not argv:
                raise FileNotFoundError("the container has no command (and no image here)")
            cwd = _mounted(container.get("workingDir") or "", mounts) or None
            pod.process = spawn(argv, log_path, env=env, cwd=cwd)
        except OSError as e:
            # The kubelet's StartError: the container never runs and the pod fails.
            with open(log_path, "a") as out:
                out.write(f"node: cannot start {argv}: {e}\n")
            if pod.stage == 0:
                self._mark_started(pod)
            self._container_ended(pod, 128, "StartError", str(e))
            self._finish(pod, BACKOFF_LIMIT_EXCEEDED)
            return
        if pod.stage == 0:
            self._mark_started(pod)
        log.info("node: Job %s runs %s as pid %d", pod.name, container.get("name"), pod.process.pid)

    def _volumes(self, pod: _Pod) -> Path:
        assert self._log_dir is not None
        return self._log_dir / f"{pod.name}.volumes"

    def _mounts(self, pod: _Pod, container: Manifest) -> dict[str, str]:
        """mountPath -> the pod's folder, for the container's emptyDir mounts."""
        spec = pod.job["spec"]["template"]["spec"]
        empty = {v["name"] for v in spec.get("volumes") or [] if "emptyDir" in v}
        mounts = {}
        for mount in container.get("volumeMounts") or []:
            if mount.get("name") in empty:
                folder = self._volumes(pod) / mount["name"]
                folder.mkdir(parents=True, exist_ok=True)
                mounts[mount["mountPath"].rstrip("/")] = str(folder)
        return mounts

    def _environment(self, container: Manifest, mounts: dict[str, str]) -> dict[str, str] | None:
        """The process environment, or None while a Secret it needs is missing."""
        env = {k: v for k, v in os.environ.items() if k != "AGL_ADMIN_TOKEN"}
        for var in container.get("env") or []:
            source = var.get("valueFrom")
            if source is None:
                env[var["name"]] = _mounted(var.get("value", ""), mounts)
                continue
            ref = source.get("secretKeyRef")
            if ref is None:
                log.warning("node: env %s: only secretKeyRef is supported; left unset", var["name"])
                continue
            value = self._secret_value(ref["name"], ref["key"])
            if value is not None:
                env[var["name"]] = value
            elif not ref.get("optional"):
                return None
        return env

    def _secret_value(self, name: str, key: str) -> str | None:
        try:
            secret = self._core.read_namespaced_secret(name, self._namespace)
        except ApiException as e:
            if e.status != 404:
                log.info("node: reading Secret %s: %s", name, e.status)
            return None
        except TRANSIENT as e:
            log.info("node: reading Secret %s: %s", name, e)
            return None
        if key in (secret.data or {}):
            return base64.b64decode(secret.data[key]).decode()
        # No per-type strategy on this server turns stringData into data: read both.
        return (secret.string_data or {}).get(key)

    def _mark_started(self, pod: _Pod) -> None:
        with self._lock:
            self._started.append(pod.name)
            self._running[pod.uid] = pod.name

    def _drop(self, pod: _Pod) -> None:
        """Kill the pod's process group and forget it, writing no status. Leaves
        :meth:`running` only once the process is gone (and reaped)."""
        del self._pods[pod.uid]
        if pod.process is not None:
            kill_group(pod.process)
        if self._log_dir is not None:
            shutil.rmtree(self._volumes(pod), ignore_errors=True)
        with self._lock:
            self._running.pop(pod.uid, None)

    def _finish(self, pod: _Pod, failure: Failure | None) -> None:
        killed = pod.process is not None and pod.process.poll() is None
        self._drop(pod)
        if killed:
            self._container_ended(pod, 137, "Error")
        if failure is None:
            self._write_pod_status(pod, "Succeeded")
        elif failure is DEADLINE_EXCEEDED:
            message = "Pod was active on the node longer than the specified deadline"
            self._write_pod_status(pod, "Failed", "DeadlineExceeded", message)
        else:
            self._write_pod_status(pod, "Failed")
        # The Job's end is written after its pod's, as in a cluster: whoever sees the Job
        # finished finds the pod's final state.
        self._writer.patch(pod.job, final_status(failure, datetime.now(UTC)))

    # -- the Pod, its Node and its logs (process mode)

    def _register_node(self) -> None:
        if self._kubelet is None:
            return
        try:
            self._core.create_node({"metadata": {"name": self.node_name}})
            status = {
                "addresses": [
                    {"type": "InternalIP", "address": "127.0.0.1"},
                    {"type": "Hostname", "address": self.node_name},
                ],
                "daemonEndpoints": {"kubeletEndpoint": {"Port": self._kubelet.port}},
                "conditions": [{"type": "Ready", "status": "True"}],
            }
            self._core.patch_node_status(
                self.node_name, {"status": status}, _content_type=MERGE_PATCH
            )
        except (ApiException, *TRANSIENT) as e:
            log.warning("node: registering Node %s: %s; no pod logs", self.node_name, e)

    def _create_pod(self, pod: _Pod) -> None:
        template = pod.job["spec"]["template"]
        meta = template.get("metadata") or {}
        name = f"{pod.name}-{secrets.token_hex(3)[:5]}"
        owner = {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "name": pod.name,
            "uid": pod.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }
        labels = {
            **(meta.get("labels") or {}),
            "job-name": pod.name,
            "batch.kubernetes.io/job-name": pod.name,
            "controller-uid": pod.uid,
            "batch.kubernetes.io/controller-uid": pod.uid,
        }
        body = {
            "metadata": {
                "name": name,
                "labels": labels,
                "annotations": meta.get("annotations") or {},
                "ownerReferences": [owner],
            },
            "spec": {**template["spec"], "nodeName": self.node_name},
        }
        try:
            self._core.create_namespaced_pod(self._namespace, body, _preload_content=False)
        except (ApiException, *TRANSIENT) as e:
            log.warning("node: creating the pod of Job %s: %s; it runs without one", pod.name, e)
            return
        pod.pod_name = name
        self._pod_names[pod.uid] = name
        assert self._log_dir is not None
        with self._lock:
            self._logs[name] = _PodLogs(self._log_dir / f"{pod.name}.log")

    def _delete_pod(self, name: str) -> None:
        with self._lock:
            self._logs.pop(name, None)
        try:
            self._core.delete_namespaced_pod(name, self._namespace, _preload_content=False)
        except (ApiException, *TRANSIENT) as e:
            if not isinstance(e, ApiException) or e.status != 404:
                log.warning("node: deleting pod %s: %s", name, e)

    def _container_started(self, pod: _Pod, log_path: Path) -> None:
        if pod.pod_name is None:
            return
        container = pod.containers[pod.stage]["name"]
        now = rfc3339(datetime.now(UTC))
        pod.started_at = pod.started_at or now
        with self._lock:
            logs = self._logs.get(pod.pod_name)
            if logs is not None:
                size = log_path.stat().st_size if log_path.exists() else 0
                logs.spans[container] = (size, None)
        pod.statuses[container] = {"running": {"startedAt": now}}
        # Pending while an init container runs, as a kubelet reports it.
        self._write_pod_status(
            pod, "Running" if pod.stage + 1 == len(pod.containers) else "Pending"
        )

    def _container_ended(self, pod: _Pod, code: int, reason: str, message: str = "") -> None:
        if pod.pod_name is None:
            return
        container = pod.containers[pod.stage]["name"]
        with self._lock:
            logs = self._logs.get(pod.pod_name)
            if logs is not None and container in logs.spans:
                end = logs.path.stat().st_size if logs.path.exists() else 0
                logs.spans[container] = (logs.spans[container][0], end)
        started = pod.statuses.get(container, {}).get("running", {}).get("startedAt")
        terminated = {
            "exitCode": code,
            "reason": reason,
            "startedAt": started,
            "finishedAt": rfc3339(datetime.now(UTC)),
        }
        if message:
            terminated["message"] = message
        pod.statuses[container] = {"terminated": terminated}

    def _write_pod_status(
        self, pod: _Pod, phase: str, reason: str | None = None, message: str | None = None
    ) -> None:
        if pod.pod_name is None:
            return
        spec = pod.job["spec"]["template"]["spec"]

        waiting = {"waiting": {"reason": "PodInitializing"}}

        def statuses(containers: list[Manifest]) -> list[Manifest]:
            return [
                {
                    "name": c["name"],
                    "image": c.get("image", ""),
                    "imageID": "",
                    "ready": "running" in pod.statuses.get(c["name"], {}),
                    "restartCount": 0,
                    "state": pod.statuses.get(c["name"]) or waiting,
                }
                for c in containers
            ]

        status: Manifest = {
            "phase": phase,
            "hostIP": "127.0.0.1",
            "startTime": pod.started_at,
            "initContainerStatuses": statuses(spec.get("initContainers") or []),
            "containerStatuses": statuses(spec["containers"][:1]),
        }
        if reason is not None:
            status |= {"reason": reason, "message": message}
        try:
            self._core.patch_namespaced_pod_status(
                pod.pod_name,
                self._namespace,
                {"status": status},
                _content_type=MERGE_PATCH,
                _preload_content=False,
            )
        except (ApiException, *TRANSIENT) as e:
            log.warning("node: status of pod %s: %s", pod.pod_name, e)

    def _container_log(self, namespace: str, pod: str, container: str) -> bytes | None:
        """For the kubelet's threads: what the container wrote so far."""
        with self._lock:
            logs = self._logs.get(pod) if namespace == self._namespace else None
            span = None if logs is None else logs.spans.get(container)
        if logs is None or span is None:
            return None
        start, end = span
        try:
            with logs.path.open("rb") as f:
                f.seek(start)
                return f.read() if end is None else f.read(end - start)
        except FileNotFoundError:
            return b""


def _mounted(value: str, mounts: dict[str, str]) -> str:
    """``value`` with a leading mount path replaced by the pod's folder for it."""
    for path, folder in mounts.items():
        if value == path or value.startswith(path + "/"):
            return folder + value[len(path) :]
    return value
