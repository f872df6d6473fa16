"""``NodeSimulator``: the Job controller and the kubelet for an API server that has
neither. It runs a Job's container command as a local process (or decides an outcome) and
writes the Job's status as the real controller would."""

from __future__ import annotations

import base64
import heapq
import itertools
import json
import logging
import os
import queue
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
from agl.testing.k8s.node_api import TRANSIENT, JobEvent, JobWatcher, StatusWriter
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


class NodeSimulator:
    """The Job controller and the kubelet, for an API server that has neither.

    Each new Job (matching ``label_selector`` in ``namespace``) gets ``startTime`` and
    ``active: 1`` at once; then, unless ``start(job)`` says no (a node that never starts
    it), its pod runs: each init container, then the first container, one after the other
    while each exits 0, its ``command + args`` as a local process with the test's
    environment (less ``AGL_ADMIN_TOKEN``) plus the container's ``env`` (literal values and
    ``secretKeyRef`` read from the API server, retried every 0.2 s while missing, as the
    kubelet does), in ``workingDir``, output to ``log_dir/<job>.log``. An ``emptyDir``
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
        # Shared with readers, under _lock:
        self._lock = threading.Lock()
        self._started: list[str] = []
        self._running: dict[str, str] = {}  # uid -> job name

    # -- lifecycle

    def start(self) -> NodeSimulator:
        if self._log_dir is not None:
            self._log_dir.mkdir(parents=True, exist_ok=True)
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
        for uid in [uid for uid in self._pods if uid not in listed]:
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

    def _admit(self, job: Manifest) -> None:
        now = datetime.now(UTC)
        recorded = (job.get("status") or {}).get("startTime")
        start_time = datetime.fromisoformat(recorded) if recorded else now
        if not recorded:
            self._writer.patch(job, {"startTime": rfc3339(now), "active": 1})
        pod = _Pod(job)
        self._pods[pod.uid] = pod
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
        self._drop(pod)
        self._writer.patch(pod.job, final_status(failure, datetime.now(UTC)))


def _mounted(value: str, mounts: dict[str, str]) -> str:
    """``value`` with a leading mount path replaced by the pod's folder for it."""
    for path, folder in mounts.items():
        if value == path or value.startswith(path + "/"):
            return folder + value[len(path) :]
    return value
