"""``K8sExecutor``: one Kubernetes Job per rollout attempt (docs/design.md, "Rollout controller").

For each attempt the executor creates, in its namespace:

- a Secret holding the attempt's key (``api-key``), named like the Job; the agent's
  container reads ``OPENAI_API_KEY`` from it (``secretKeyRef``), so the key is never in
  the Job's spec, which anyone who may list Jobs can read;
- a Job rendered from the user's template (Jinja2 over YAML: a plain YAML Job renders to
  itself), with what the controller owns set over it: a deterministic name per attempt,
  labels and annotations, ``backoffLimit: 0``, ``restartPolicy: Never``,
  ``activeDeadlineSeconds`` from the rollout's timeout, ``ttlSecondsAfterFinished`` and
  the agent's environment.

Those objects are built in ``manifests`` (no API calls); this module makes the calls and
keeps the state.

It learns what the Jobs do from a label-selected watch, re-opened from the last
resourceVersion it saw (after ``watch_timeout_s``, or a dropped connection, with
backoff while the API server is away); a 410 Gone (that version was compacted away)
makes it list every Job again, and so does ``relist_s``, to recover whatever a watch may
have missed. Jobs it did not create but carry its labels (a previous controller's) are
adopted.

Invariants:
- an attempt has at most one Job: its name is a function of (instance, rollout, attempt),
  so a retried or repeated create gets 409 and launches nothing;
- every Job tracked yields exactly one ``Exit`` per executor: Complete (None), Failed
  (its reason and message), or deleted before it finished;
- a Job that finished has its pods' logs read (``pod_logs``) before its ``Exit`` is
  given, so they travel with it to the gateway; meanwhile (``ENDING``) the attempt still
  counts as running, and a restarted controller reads them from the Jobs it adopts;
- a Job and its Secret are deleted only after ``forget()``, i.e. once the controller has
  recorded the exit at the gateway; until then a restarted controller finds the Job and
  settles it again (a no-op where it took);
- the API server's answers are handled where they are known: 409 on create is success,
  404 on delete is success, 4xx on create fails the attempt with the server's message,
  5xx / 429 / a dropped connection is retried with backoff for up to ``create_retry_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import orjson
import urllib3
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException
from kubernetes.watch.watch import iter_resp_lines

from agl.backends.execution.k8s.api_errors import RETRYABLE, api_message
from agl.backends.execution.k8s.config import K8sExecutorConfig
from agl.backends.execution.k8s.job_state import job_attempt, job_outcome
from agl.backends.execution.k8s.manifests import (
    KEY_ENV,
    egress_policy,
    job_manifest,
    load_template,
    secret_manifest,
)
from agl.backends.execution.k8s.naming import INSTANCE, MANAGED_BY, ROLE, job_name
from agl.backends.execution.k8s.pacing import TokenBucket
from agl.backends.execution.k8s.pod_logs import read_job_logs
from agl.core.contracts.execution import ORPHANED, Exit, Key, Launch

# Named for the package: the name log lines and logging settings know the executor by.
log = logging.getLogger("agl.backends.execution.k8s")

T = TypeVar("T")

DELETED = "Job deleted before it finished"

CREATING, ACTIVE, ENDING, ENDED, FORGOTTEN = "creating", "active", "ending", "ended", "forgotten"
RUNNING = (CREATING, ACTIVE, ENDING)  # what the controller must not think lost


@dataclass
class _Tracked:
    key: tuple[str, int]
    state: str
    seq: int  # when it was last known to exist (the relist that may miss it must be later)
    stop_reason: str | None = None


@dataclass
class K8sStats:
    jobs_created: int = 0
    jobs_adopted: int = 0
    jobs_deleted: int = 0
    relists: int = 0
    watch_expired: int = 0  # 410 Gone: the watch's version was compacted away
    watch_restarts: int = 0
    api_errors: int = 0
    requests: int = 0  # API requests made, watches and lists included


class K8sExecutor:
    """Implements ``agl.core.controller.reconcile.Executor`` with Kubernetes Jobs (``detached``:
    the Jobs outlive this process; the next controller adopts them)."""

    def __init__(self, config: K8sExecutorConfig, *, base_dir: Path | None = None) -> None:
        self.config = config
        self.detached = not config.delete_on_close
        self.template = load_template(config.template, base_dir)
        self.stats = K8sStats()
        self.labels = {MANAGED_BY: "agl", INSTANCE: config.instance}
        self.selector = ",".join(f"{k}={v}" for k, v in self.labels.items())
        self._jobs: dict[str, _Tracked] = {}
        self._exits: list[Exit] = []
        self._lock = threading.Lock()
        self._stats_lock = threading.Lock()
        self._seq = 0
        self._stopping = threading.Event()
        self._watcher: threading.Thread | None = None
        self._pool = ThreadPoolExecutor(config.api_threads, thread_name_prefix="k8s-api")
        self._bucket = TokenBucket(config.create_qps, config.create_burst)
        self._started = False
        self._api: k8s.ApiClient | None = None
        self._version: str | None = None  # of the first list, where the watch starts
        self._deleting: set[asyncio.Future[None]] = set()

    # -- the Executor protocol -------------------------------------------------------------

    @property
    def free_slots(self) -> int:
        if not self._started or self._stopping.is_set():
            return 0
        with self._lock:
            busy = sum(t.state in RUNNING for t in self._jobs.values())
        # Only what can be created now: an attempt moved to running but waiting for its
        # Job would be lost (and its attempt spent) if the controller stopped meanwhile.
        return max(0, min(self.config.max_jobs - busy, self._bucket.available()))

    def running(self) -> set[Key]:
        with self._lock:
            return {t.key for t in self._jobs.values() if t.state in RUNNING}

    async def start(self) -> None:
        """Connect, ensure the NetworkPolicy, adopt the Jobs there are, start watching.
        ValueError (one line) when the cluster cannot be used. Idempotent."""
        if self._api is not None:
            return
        self._api = await self._call(self._connect)
        self.batch = k8s.BatchV1Api(self._api)
        self.core = k8s.CoreV1Api(self._api)
        self.networking = k8s.NetworkingV1Api(self._api)
        try:
            if self.config.egress.enabled:
                await self._call(self._ensure_policy)
            self._version = await self._call(self._relist)
        except ApiException as error:
            raise ValueError(f"Kubernetes API: {api_message(error)}") from None
        except (urllib3.exceptions.HTTPError, OSError) as error:
            raise ValueError(f"Kubernetes API unreachable: {error}") from None
        self._watcher = threading.Thread(target=self._watch_loop, name="k8s-watch", daemon=True)
        self._watcher.start()
        self._started = True

    async def launch(self, launch: Launch) -> None:
        name = job_name(self.config.instance, launch.rollout_id, launch.attempt)
        with self._lock:
            if name in self._jobs:
                return  # launching is idempotent per attempt
            self._jobs[name] = _Tracked((launch.rollout_id, launch.attempt), CREATING, -1)
        try:
            await self._bucket.take()
            job = self._job(name, launch)
            await self._call(
                self._create_secret, name, launch.env.get(KEY_ENV, ""), launch.report_key
            )
            try:
                await self._call(self._create_job, job)
            except ValueError:  # refused: its Secret must not linger
                await self._call(self._delete, name, job=False)
                raise
        except BaseException:
            with self._lock:  # a Job that was created after all is adopted by a relist
                self._jobs.pop(name, None)
            raise
        with self._lock:
            tracked = self._jobs.get(name)
            if tracked is not None and tracked.state == CREATING:
                tracked.state, tracked.seq = ACTIVE, self._next_seq()

    async def exits(self) -> list[Exit]:
        with self._lock:
            exits, self._exits = self._exits, []
        return exits

    async def forget(self, rollout_id: str, attempt: int) -> None:
        """The exit is recorded at the gateway: delete the Job and its Secret, in the
        background (the controller's pass need not wait; a relist retries a failure)."""
        name = job_name(self.config.instance, rollout_id, attempt)
        with self._lock:
            tracked = self._jobs.get(name)
            if tracked is None or tracked.state != ENDED:
                return
            tracked.state = FORGOTTEN
        deletion = asyncio.ensure_future(self._call(self._delete, name))
        self._deleting.add(deletion)
        deletion.add_done_callback(self._deleting.discard)

    async def stop(self, keys: set[Key]) -> None:
        """Delete these attempts' Jobs; each ends with an ``Exit`` saying so."""
        names = []
        with self._lock:
            for rollout_id, attempt in keys:
                name = job_name(self.config.instance, rollout_id, attempt)
                tracked = self._jobs.get(name)
                if tracked is not None and tracked.state == ACTIVE:
                    tracked.stop_reason = ORPHANED
                    names.append(name)
        await asyncio.gather(*(self._call(self._delete, n) for n in names))

    async def close(self) -> None:
        if self._stopping.is_set():
            return
        self._stopping.set()
        if self._deleting:
            await asyncio.wait(self._deleting, timeout=10)
        if self.config.delete_on_close and self._api is not None:
            with self._lock:
                names = list(self._jobs)
            await asyncio.gather(*(self._call(self._delete, n) for n in names))
        if self._watcher is not None:
            await asyncio.to_thread(self._watcher.join, 2.0)
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._api is not None:
            self._api.close()

    # -- building the Job ----------------------------------------------------------------------

    def _job(self, name: str, launch: Launch) -> dict[str, Any]:
        return job_manifest(
            self.template,
            name,
            launch,
            namespace=self.config.namespace,
            labels=self.labels,
            default_deadline_s=self.config.active_deadline_s,
            ttl_after_finished_s=self.config.ttl_after_finished_s,
            grader=self.config.grader,
            grading=self.config.grading,
            pod=self.config.pod,
        )

    # -- API calls (blocking; run on the pool) ------------------------------------------------

    async def _call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    def _connect(self) -> k8s.ApiClient:
        try:
            if self.config.kubeconfig:
                path = str(Path(self.config.kubeconfig).expanduser())
                return k8s_config.new_client_from_config(path)
            try:
                k8s_config.load_incluster_config()
                return k8s.ApiClient()
            except k8s_config.ConfigException:
                return k8s_config.new_client_from_config()
        except (k8s_config.ConfigException, OSError, TypeError) as error:
            raise ValueError(f"no Kubernetes configuration: {error}") from None

    def _retrying(self, what: str, fn: Callable[[], Any]) -> None:
        """``fn()`` (a call made with ``_preload_content=False``: its answer is not needed,
        and turning it into the client's models costs more CPU than the request) retried
        through 429/5xx and dropped connections, with backoff."""
        deadline = time.monotonic() + self.config.create_retry_s
        wait = 0.1
        while True:
            self._count()
            try:
                response = fn()
                response.read()
                response.release_conn()
                return
            except ApiException as error:
                if error.status not in RETRYABLE or time.monotonic() > deadline:
                    raise
                self.stats.api_errors += 1
                log.warning("%s: %s; retrying in %.1f s", what, api_message(error), wait)
            except (urllib3.exceptions.HTTPError, OSError) as error:
                if time.monotonic() > deadline:
                    raise
                self.stats.api_errors += 1
                log.warning("%s: %r; retrying in %.1f s", what, error, wait)
            if self._stopping.wait(wait):
                raise RuntimeError(f"{what}: the executor is closing")
            wait = min(wait * 2, 5.0)

    def _create_secret(self, name: str, key: str, report_key: str) -> None:
        body = secret_manifest(name, self.labels, key, report_key)
        try:
            self._retrying(
                f"creating Secret {name}",
                lambda: self.core.create_namespaced_secret(
                    self.config.namespace, body, _preload_content=False
                ),
            )
        except ApiException as error:
            if error.status != 409:  # 409: a retry of ours; the key of an attempt is fixed
                message = api_message(error)
                raise ValueError(f"the API server refused the Secret: {message}") from None

    def _create_job(self, job: dict[str, Any]) -> None:
        name = job["metadata"]["name"]
        try:
            self._retrying(
                f"creating Job {name}",
                lambda: self.batch.create_namespaced_job(
                    self.config.namespace, job, _preload_content=False
                ),
            )
        except ApiException as error:
            if error.status == 409:
                log.info("Job %s exists already: not launched again", name)
                return
            raise ValueError(f"the API server refused the Job: {api_message(error)}") from None
        self.stats.jobs_created += 1

    def _delete(self, name: str, *, job: bool = True) -> None:
        """Delete the Job (with its pods) and its Secret; gone already is fine."""
        targets: list[tuple[str, Callable[[], Any]]] = [
            (
                "Secret",
                lambda: self.core.delete_namespaced_secret(
                    name, self.config.namespace, _preload_content=False
                ),
            )
        ]
        if job:
            targets.insert(
                0,
                (
                    "Job",
                    lambda: self.batch.delete_namespaced_job(
                        name,
                        self.config.namespace,
                        propagation_policy="Background",
                        _preload_content=False,
                    ),
                ),
            )
        for kind, delete in targets:
            try:
                self._retrying(f"deleting {kind} {name}", delete)
                if kind == "Job":
                    self.stats.jobs_deleted += 1
            except ApiException as error:
                if error.status != 404:
                    log.warning("deleting %s %s: %s", kind, name, api_message(error))
            except (urllib3.exceptions.HTTPError, OSError, RuntimeError) as error:
                log.warning("deleting %s %s: %r (the next relist retries)", kind, name, error)

    def _ensure_policy(self) -> None:
        name = f"{self.config.instance}-agent-egress"
        body = egress_policy(
            name,
            self.config.namespace,
            {**self.labels, ROLE: "agent"},
            self.config.egress,
            self.config.agent_gateway_url,
        )
        ns = self.config.namespace
        self._count()
        try:
            self.networking.create_namespaced_network_policy(ns, body)
            log.info("NetworkPolicy %s created", name)
            return
        except ApiException as error:
            if error.status != 409:
                raise
        self._count()
        current = self.networking.read_namespaced_network_policy(name, ns, _preload_content=False)
        existing = orjson.loads(current.data)
        if existing.get("spec") != body["spec"]:
            body["metadata"]["resourceVersion"] = existing["metadata"]["resourceVersion"]
            self._count()
            self.networking.replace_namespaced_network_policy(name, ns, body)
            log.info("NetworkPolicy %s updated", name)

    # -- watching ------------------------------------------------------------------------------

    def _count(self) -> None:
        with self._stats_lock:
            self.stats.requests += 1

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _relist(self) -> str:
        """List every Job (and Secret) of ours; reconcile; answer the resourceVersion."""
        with self._lock:
            since = self._next_seq()
        items: list[dict[str, Any]] = []
        token: str | None = None
        version = ""
        while True:
            self._count()
            response = self.batch.list_namespaced_job(
                self.config.namespace,
                label_selector=self.selector,
                limit=500,
                _continue=token,
                _preload_content=False,
            )
            page = orjson.loads(response.data)
            items.extend(page.get("items") or [])
            version = page["metadata"].get("resourceVersion", version)
            token = page["metadata"].get("continue")
            if not token:
                break
        self.stats.relists += 1
        present = {item["metadata"]["name"] for item in items}
        with self._lock:
            for item in items:
                self._observe("ADDED", item)
            for name, tracked in list(self._jobs.items()):
                if name in present or tracked.seq >= since or tracked.state == CREATING:
                    continue
                self._observe_gone(name, tracked)
            stale = [n for n in present if self._jobs.get(n, _NONE).state == FORGOTTEN]
        for name in stale:  # an earlier delete did not take
            self._delete(name)
        self._collect_secrets(present)
        return version

    def _collect_secrets(self, jobs: set[str]) -> None:
        """Delete Secrets of ours with no Job (a launch that died between the two)."""
        self._count()
        response = self.core.list_namespaced_secret(
            self.config.namespace, label_selector=self.selector, _preload_content=False
        )
        names = [s["metadata"]["name"] for s in orjson.loads(response.data).get("items") or []]
        with self._lock:
            orphans = [
                n for n in names if n not in jobs and self._jobs.get(n, _NONE).state != CREATING
            ]
        for name in orphans:
            self._delete(name, job=False)

    def _observe(self, kind: str, job: dict[str, Any]) -> None:
        """One Job as the server has it now (lock held)."""
        name = job["metadata"]["name"]
        tracked = self._jobs.get(name)
        if kind == "DELETED":
            if tracked is not None:
                self._observe_gone(name, tracked)
            return
        if tracked is None:
            key = job_attempt(job)
            if key is None:
                log.warning("Job %s carries our labels but no attempt annotation", name)
                return
            tracked = self._jobs[name] = _Tracked(key, ACTIVE, self._seq)
            self.stats.jobs_adopted += 1
            log.info("adopted Job %s (%s attempt %d)", name, *key)
        tracked.seq = max(tracked.seq, self._seq)
        if tracked.state in (CREATING, ACTIVE):
            finished, error = job_outcome(job)
            if finished:
                self._ending(name, tracked, error)

    def _ending(self, name: str, tracked: _Tracked, error: str | None) -> None:
        """The Job finished: its Exit, with its pods' logs once read (lock held)."""
        if self.config.pod_log_bytes == 0:
            tracked.state = ENDED
            self._exits.append(Exit(*tracked.key, error))
            return
        tracked.state = ENDING
        # A shut pool: the executor is closing, and the next controller adopts the Job.
        with contextlib.suppress(RuntimeError):
            self._pool.submit(self._exit_with_logs, name, tracked, error)

    def _exit_with_logs(self, name: str, tracked: _Tracked, error: str | None) -> None:
        logs, requests = read_job_logs(
            self.core, self.config.namespace, name, self.config.pod_log_bytes
        )
        with self._stats_lock:
            self.stats.requests += requests
        with self._lock:
            if tracked.state == ENDING:
                tracked.state = ENDED
                self._exits.append(Exit(*tracked.key, error, logs))

    def _observe_gone(self, name: str, tracked: _Tracked) -> None:
        if tracked.state in (CREATING, ACTIVE):
            self._exits.append(Exit(*tracked.key, tracked.stop_reason or DELETED))
            tracked.state = ENDED
        elif tracked.state == FORGOTTEN:
            del self._jobs[name]

    def _watch_loop(self) -> None:
        version = self._version
        backoff = 0.1
        next_relist = time.monotonic() + self.config.relist_s
        while not self._stopping.is_set():
            try:
                if version is None or time.monotonic() >= next_relist:
                    version = self._relist()
                    next_relist = time.monotonic() + self.config.relist_s
                if not self.config.watch:
                    self._stopping.wait(max(0.0, next_relist - time.monotonic()))
                    continue
                until = min(next_relist, time.monotonic() + self.config.watch_timeout_s)
                version = self._watch(version, until)
                backoff = 0.1
                continue
            except ApiException as error:
                if error.status == 410:
                    log.info("watch expired (410 Gone): relisting")
                    self.stats.watch_expired += 1
                    version = None
                    continue
                self.stats.api_errors += 1
                log.warning("watching Jobs: %s; again in %.1f s", api_message(error), backoff)
            except Exception as error:  # the API server went away, or a bug: never give up
                # Keep ``version``: the next watch resumes there, or learns it is gone (410).
                self.stats.api_errors += 1
                log.warning("watching Jobs: %r; again in %.1f s", error, backoff)
            if self._stopping.wait(backoff):
                return
            backoff = min(backoff * 2, 5.0)

    def _watch(self, version: str, until: float) -> str:
        """Follow changes from ``version`` until ``until`` (or the executor closes);
        answers the last version seen. ApiException(410) when ``version`` is too old."""
        timeout = max(1, round(until - time.monotonic()))
        self._count()
        self.stats.watch_restarts += 1
        response = self.batch.list_namespaced_job(
            self.config.namespace,
            label_selector=self.selector,
            watch=True,
            allow_watch_bookmarks=True,
            resource_version=version,
            timeout_seconds=timeout,
            _preload_content=False,
            _request_timeout=(10, timeout + 30),
        )
        try:
            for line in iter_resp_lines(response):
                if not line:
                    continue
                event = orjson.loads(line)
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    raise ApiException(status=obj.get("code"), reason=obj.get("message"))
                version = obj.get("metadata", {}).get("resourceVersion", version)
                if kind != "BOOKMARK":
                    with self._lock:
                        self._observe(kind, obj)
                if self._stopping.is_set():
                    break
        finally:
            response.close()
            response.release_conn()
        return version


_NONE = _Tracked(("", 0), "", 0)
